"""big_vision's ViT recipe in flax, timed like ``shardkit bench --chip`` (benchmark only).

The architecture and numerics of google-research/big_vision ``big_vision/models/vit.py`` as its
configs train ViT-B/16 with ``dtype_mm="bfloat16"`` (written here from that description, no
code copied): images cast to bf16, a strided conv patch embedding and the learned position
embedding in bf16, 12 unrolled pre-LN blocks (``nn.LayerNorm``; ``nn.MultiHeadDotProductAttention``
and the MLP's ``nn.Dense`` layers in bf16, tanh GELU), the final LayerNorm, mean pooling
("gap") and a float32 head; AdamW from ``vit_ref.make_optimizer``; the step jitted with params
and optimizer state donated. Needs flax (``pip install flax``): not a shardkit dependency.

    python docs/measure/tpu_bigvision.py --batches 32,64,128,256 --json OUT.json
"""

import argparse
import json
import statistics

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import vit_ref
from shardkit.run.bench import model_flops
from shardkit.run.throughput import chip_peak, time_step

BF16 = jnp.bfloat16


class Mlp(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        init = dict(kernel_init=nn.initializers.xavier_uniform(),
                    bias_init=nn.initializers.normal(stddev=1e-6))  # fmt: skip
        y = nn.gelu(nn.Dense(self.hidden, dtype=BF16, **init)(x))
        return nn.Dense(x.shape[-1], dtype=BF16, **init)(y)


class Block(nn.Module):
    heads: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        attention = nn.MultiHeadDotProductAttention(
            num_heads=self.heads, kernel_init=nn.initializers.xavier_uniform(), dtype=BF16
        )
        x = x + attention(y, y)
        return x + Mlp(self.hidden)(nn.LayerNorm()(x))


class ViT(nn.Module):
    cfg: vit_ref.ViTConfig

    @nn.compact
    def __call__(self, images):
        c = self.cfg
        x = nn.Conv(c.dim, (c.patch, c.patch), strides=(c.patch, c.patch), padding="VALID",
                    dtype=BF16)(jnp.asarray(images, BF16))  # fmt: skip
        n, h, w, d = x.shape
        x = x.reshape(n, h * w, d)
        pos = self.param("pos_embedding", nn.initializers.normal(1 / np.sqrt(d)), (1, h * w, d))
        x = x + pos.astype(x.dtype)
        for _ in range(c.depth):
            x = Block(c.heads, c.mlp_dim)(x)
        x = nn.LayerNorm()(x).mean(axis=1)
        return nn.Dense(c.classes, kernel_init=nn.initializers.zeros)(x)


def step_and_args(cfg: vit_ref.ViTConfig, batch: int):
    model = ViT(cfg)
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(batch, cfg.image, cfg.image, cfg.channels)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, cfg.classes, batch), jnp.int32)
    params = model.init(jax.random.key(0), images[:1])
    optimizer = vit_ref.make_optimizer()
    state = optimizer.init(params)

    def step(params, state, images, labels):
        def loss(p):
            logits = model.apply(p, images).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, {"loss": value}

    return jax.jit(step, donate_argnums=(0, 1)), (params, state, images, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="32,64,128,256")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    cfg = vit_ref.variant("B/16", dtype="bfloat16", pool="gap")
    kind, peak, _ = chip_peak()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        row = {"model": "big_vision (flax)", "batch": batch, "remat": "none", "error": None}
        try:
            timing = time_step(*step_and_args(cfg, batch), args.steps, 2)
            step_s = statistics.median(timing.times)
            row |= dict(step_s=step_s, images_per_s=batch / step_s, compile_s=timing.compile_s,
                        mfu=model_flops(cfg, batch) / step_s / peak, temp_bytes=timing.temp_bytes,
                        peak_bytes=timing.peak_bytes, pipelined_s=timing.pipelined_s,
                        pipelined_images_per_s=batch / timing.pipelined_s)  # fmt: skip
        except (jax.errors.JaxRuntimeError, RuntimeError) as err:
            row["error"] = str(err).splitlines()[0][:200]
        print(row, flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device_kind": kind, "peak_flops_per_s": peak, "rows": rows}, f)


if __name__ == "__main__":
    main()
