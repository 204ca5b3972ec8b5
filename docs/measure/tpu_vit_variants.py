"""Where a ViT train step's time goes on one chip: vit_ref's numerics varied one at a time.

Each variant is vit_ref's forward with some choices changed, timed like ``bench --chip``
(AdamW, params and state donated, median of 10 steps):

  loop       the blocks as a Python loop (XLA sees every layer) instead of ``lax.scan``
  unroll     ``lax.scan(..., unroll=depth)``: one straight-line body, params still stacked
  remat      none | dots | full (``vit_ref.REMAT``), per block
  residual   float32 | bfloat16: the dtype of the residual stream between blocks
  scores     float32 | bfloat16: attention logits and softmax
  qkv        split | fused: three projections or one [d, 3, h, k] matmul
  heads      major: q, k, v projected head-major ([b, h, t, k]), the core's einsums over
             (b, h) batch dims, the out projection from [b, h, t, k]
  attn       ref | flax: flax's order (q scaled by a Python float, then bf16 logits and softmax)
  layers     stacked | list: per-layer params as one [depth, ...] array or a list of trees
  norm       1: also compute the gradients' global norm (as ``vit_ref.make_train_step`` does)
  accum      N: the batch as N micro-batches under ``lax.scan``, gradients summed, one update
  chunk      N: attention's core over batch chunks of N images (``lax.map``), or with
             ``chunks=unrolled`` as a Python loop over slices

    python docs/measure/tpu_vit_variants.py --batch 32 base loop res=bf16 ...
"""

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax

import vit_ref
from shardkit.run.bench import model_flops
from shardkit.run.throughput import chip_peak, time_step
from vit_ref import model as ref


def attention(q, k, v, scores):
    if scores == "heads_major":  # q, k, v: [b, h, t, k]
        q = q * (1.0 / float(np.sqrt(q.shape[-1])))
        probs = jax.nn.softmax(jnp.einsum("bhqk,bhsk->bhqs", q, k), axis=-1)
        return jnp.einsum("bhqs,bhsk->bhqk", probs.astype(v.dtype), v)
    if scores == "flax":
        q = q * (1.0 / float(np.sqrt(q.shape[-1])))
        probs = jax.nn.softmax(jnp.einsum("bqhk,bshk->bhqs", q, k), axis=-1)
        return jnp.einsum("bhqs,bshk->bqhk", probs.astype(v.dtype), v)
    wide = jnp.float32 if scores == "f32" else q.dtype
    logits = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=wide)
    probs = jax.nn.softmax(logits * (1.0 / np.sqrt(q.shape[-1])), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", probs, v)


def by_chunks(fn, q, k, v, opts):
    chunk, b = int(opts.get("chunk", 0)), q.shape[0]
    if not chunk or chunk >= b:
        return fn(q, k, v)
    if opts.get("chunks") == "unrolled":
        parts = [
            fn(q[i : i + chunk], k[i : i + chunk], v[i : i + chunk]) for i in range(0, b, chunk)
        ]
        return jnp.concatenate(parts, axis=0)
    split = lambda a: a.reshape(b // chunk, chunk, *a.shape[1:])  # noqa: E731
    out = jax.lax.map(lambda qkv: fn(*qkv), (split(q), split(k), split(v)))
    return out.reshape(b, *out.shape[2:])


def block(x, p, dtype, opts):
    h = ref.layer_norm(x, p["ln1"]).astype(dtype)
    a = p["attn"]
    if opts.get("heads") == "major":
        q, k, v = (
            jnp.einsum("btd,dhk->bhtk", h, a[n]["kernel"].astype(dtype))
            + a[n]["bias"].astype(dtype)[:, None]
            for n in ("query", "key", "value")
        )
        o = attention(q, k, v, "heads_major")
        x = x + ref.dense(o, a["out"], "bhtk,hkd->btd", dtype).astype(x.dtype)
        return x + ref.mlp(ref.layer_norm(x, p["ln2"]), p["mlp"], dtype).astype(x.dtype)
    if opts.get("qkv") == "fused":
        w = jnp.stack([a[n]["kernel"] for n in ("query", "key", "value")], axis=1).astype(dtype)
        b = jnp.stack([a[n]["bias"] for n in ("query", "key", "value")], axis=0).astype(dtype)
        qkv = jnp.einsum("btd,dnhk->nbthk", h, w) + b[:, None, None]
        q, k, v = qkv[0], qkv[1], qkv[2]
    else:
        q, k, v = (ref.dense(h, a[n], "btd,dhk->bthk", dtype) for n in ("query", "key", "value"))
    scores = "flax" if opts.get("attn") == "flax" else opts.get("scores", "f32")
    o = by_chunks(lambda q, k, v: attention(q, k, v, scores), q, k, v, opts)
    x = x + ref.dense(o, a["out"], "bthk,hkd->btd", dtype).astype(x.dtype)
    return x + ref.mlp(ref.layer_norm(x, p["ln2"]), p["mlp"], dtype).astype(x.dtype)


def loss_fn(params, images, labels, cfg, opts):
    dtype = jnp.bfloat16
    x = ref.embed(params, images, cfg)
    if opts.get("res") == "bf16":
        x = x.astype(jnp.bfloat16)
    run = ref.remat_block(lambda x, p: block(x, p, dtype, opts), opts.get("remat", "dots"))
    if isinstance(params["blocks"], list):
        for p in params["blocks"]:
            x = run(x, p)
    elif "loop" in opts:
        for i in range(cfg.depth):
            x = run(x, jax.tree.map(lambda a, i=i: a[i], params["blocks"]))
    else:
        unroll = cfg.depth if "unroll" in opts else 1
        x, _ = jax.lax.scan(lambda x, p: (run(x, p), None), x, params["blocks"], unroll=unroll)
    x = ref.pool(ref.layer_norm(x, params["encoder_norm"]), cfg)
    logits = ref.dense(x, params["head"], "bd,do->bo", dtype).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def step_and_args(cfg, batch, opts):
    optimizer = vit_ref.make_optimizer()
    params = vit_ref.init(jax.random.key(0), cfg)
    if opts.get("layers") == "list":
        blocks = params["blocks"]
        params["blocks"] = [jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(cfg.depth)]
    state = jax.jit(optimizer.init)(params)
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(batch, cfg.image, cfg.image, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, cfg.classes, batch), jnp.int32)

    def grads_of(params, images, labels):
        n = int(opts.get("accum", 1))
        if n == 1:
            return jax.value_and_grad(loss_fn)(params, images, labels, cfg, opts)

        def micro(total, xy):
            value, grads = jax.value_and_grad(loss_fn)(params, *xy, cfg, opts)
            return jax.tree.map(jnp.add, total, (value, grads)), None

        split = lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:])  # noqa: E731
        zeros = jax.tree.map(jnp.zeros_like, (jnp.float32(0), params))
        total, _ = jax.lax.scan(micro, zeros, (split(images), split(labels)))
        return jax.tree.map(lambda a: a / n, total)

    def step(params, state, images, labels):
        value, grads = grads_of(params, images, labels)
        metrics = {"loss": value}
        if "norm" in opts:
            metrics["grad_norm"] = optax.tree.norm(grads)
        params, state = vit_ref.train.apply_optimizer(optimizer, grads, state, params)
        return params, state, metrics

    return jax.jit(step, donate_argnums=(0, 1)), (params, state, images, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("variants", nargs="+", help="base, or comma-joined key=value / loop")
    args = parser.parse_args()
    cfg = vit_ref.variant("B/16", dtype="bfloat16", head_zeroinit=False)
    _, peak, _ = chip_peak()
    for name in args.variants:
        opts = dict(o.split("=") if "=" in o else (o, "1") for o in name.split(",") if o != "base")
        step, step_args = step_and_args(cfg, args.batch, opts)
        timing = time_step(step, step_args, 10, 2)
        step_s = statistics.median(timing.times)
        mfu = model_flops(cfg, args.batch) / step_s / peak
        b2b, temp = args.batch / timing.pipelined_s, timing.temp_bytes / 1e9
        print(f"{name:<48} {args.batch / step_s:7.1f} img/s {mfu:6.1%} MFU, back to back "
              f"{b2b:7.1f} img/s, temp {temp:5.2f} GB compile {timing.compile_s:5.1f} s",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
