"""One device's attention forward + backward on a TPU: shardkit's ring (n = 1) on each kernel
against JAX's splash kernel. Run on a TPU host (``bash docs/measure/tpu_attention.sh``).

b = 1, 8 heads × 128, bf16; one ``jax.vjp`` with a random cotangent, jitted; median of the
timed calls after a warm-up. TFLOP/s counts 14·b·h·T²·d per step (forward 4, backward 10),
halved when causal. Memory: the compiled step's temp bytes (``memory_analysis``).

    python docs/measure/tpu_attention.py [--tokens 4096,8192] [--blocks 512,1024] [--jnp]
    python docs/measure/tpu_attention.py --crossover --tokens 256,512,1024,2048,4096
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.sharding import PartitionSpec as P

import shardkit.kernels.attention as kernel_lib
from shardkit.parallel.sequence import attention_local, attention_ring

B, H, D = 1, 8, 128


def shardkit_step(kernel: str, causal: bool):
    mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    ring = functools.partial(attention_ring, axis="seq", causal=causal, kernel=kernel)
    spec = P(None, "seq")
    return jax.shard_map(lambda q, k, v: ring(q, k, v)[0], mesh=mesh, in_specs=spec, out_specs=spec)


def splash_step(t: int, causal: bool, block: int):
    shape = (t, t)
    mask = masks.CausalMask(shape) if causal else masks.FullMask(shape)
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True,
    )  # fmt: skip
    kernel = splash.make_splash_mha(
        masks.MultiHeadMask([mask] * H), block_sizes=sizes, head_shards=1, q_seq_shards=1
    )

    def run(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        # [b, t, h, d] like shardkit's blocks; splash wants [h, t, d] per batch row
        qh, kh, vh = (jnp.swapaxes(x, 1, 2) for x in (q * D**-0.5, k, v))
        return jnp.swapaxes(jax.vmap(kernel)(qh, kh, vh), 1, 2)

    return run


def local_step(kernel: str, causal: bool):
    """The local core (``attention_local``): jnp is XLA's fused softmax attention."""
    return lambda q, k, v: attention_local(q, k, v, causal=causal, kernel=kernel)[0]


def crossover(opts: argparse.Namespace) -> list[dict]:
    """The local core on each kernel at ViT-like shapes (b 8, 12 heads × 64) per length."""
    rows = []
    for t in map(int, opts.tokens.split(",")):
        keys = jax.random.split(jax.random.key(t), 4)
        args = [jax.random.normal(key, (8, t, 12, 64), jnp.bfloat16) for key in keys]
        for causal in (False, True):
            for kernel in ("jnp", "pallas"):
                result = measure(local_step(kernel, causal), args, opts.reps)
                result.pop("out")
                row = {"tokens": t, "causal": causal, "contender": f"local {kernel}", **result}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def measure(fn, args, reps: int) -> dict:
    q, k, v, do = args

    def step(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(do)

    compiled = jax.jit(step).lower(q, k, v, do).compile()
    out = jax.block_until_ready(compiled(q, k, v, do))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, do))
        times.append(time.perf_counter() - start)
    temp = compiled.memory_analysis().temp_size_in_bytes
    return {"ms": 1e3 * statistics.median(times), "temp_gb": temp / 1e9, "out": out}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="4096,8192,16384,32768")
    parser.add_argument("--blocks", default="512,1024")
    parser.add_argument("--jnp", action="store_true", help="also the jnp kernel (slow)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--crossover", action="store_true", help="the local core, jnp vs pallas")
    opts = parser.parse_args()
    out_dir = os.environ.get("OUT", "/tmp/out")
    if opts.crossover:
        with open(os.path.join(out_dir, "tpu_attention_crossover.json"), "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": crossover(opts)}, f)
        return
    rows = []
    for t in map(int, opts.tokens.split(",")):
        keys = jax.random.split(jax.random.key(t), 4)
        args = [jax.random.normal(key, (B, t, H, D), jnp.bfloat16) for key in keys]
        for causal in (False, True):
            flops = 14 * B * H * t * t * D * (0.5 if causal else 1.0)
            blocks = [int(b) for b in opts.blocks.split(",")]
            contenders: dict = {f"splash b{b}": splash_step(t, causal, b) for b in blocks}
            for block in blocks:
                contenders[f"shardkit pallas b{block}"] = (block, shardkit_step("pallas", causal))
            if opts.jnp:
                contenders["shardkit jnp"] = shardkit_step("jnp", causal)
            ref = None
            for name, fn in contenders.items():
                if isinstance(fn, tuple):
                    kernel_lib.BLOCK = fn[0]
                    kernel_lib._kernel.cache_clear()
                    fn = fn[1]
                result = measure(fn, args, opts.reps)
                out = result.pop("out")
                ref = out if ref is None else ref
                err = max(
                    float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True)
                )
                row = {"tokens": t, "causal": causal, "contender": name, **result,
                       "tflops": flops / result["ms"] / 1e9, "max_diff_vs_first": err}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, "tpu_attention.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
