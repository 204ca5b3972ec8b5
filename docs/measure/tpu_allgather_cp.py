"""A zigzag ring device's attention share on one TPU chip, the ring's way (one kernel call per
hop, ``kernels.hop_masks``) at several block sizes, against the all-gather way (K and V
gathered first: two splash calls, one per query run, each against every key it sees): which
form reaches splash's whole-sequence throughput with few tokens per device (issue 26).

    OUT=... python docs/measure/tpu_allgather_cp.py     # on a TPU host (tpu_setup.sh first)

Causal, b 1, 8 heads × 128, bf16, forward + backward (``attention_bench.timed_vjp``).
Device d of a zigzag ring of n holds query chunks d and 2n − 1 − d of 2n; gathered, chunk r
attends keys [0, (r + 1)·c) under a causal mask with offset r·c: one splash call per chunk, no
log-sum-exp merge. Its share is 1/n of the causal work; TFLOP/s count that share. The rows go
to $OUT/tpu_allgather_cp.json and a table to stdout.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

import shardkit.kernels.attention as kernel_lib
from shardkit.parallel.sequence import layouts
from shardkit.run import attention_bench as ab

CASES = [(4096, 4), (8192, 4), (16384, 4), (16384, 8), (32768, 8)]  # (tokens, ring)
RING_BLOCKS = (256, 512, 1024)
GATHER_BLOCKS = (512, 1024)


def _fit(block: int, n: int) -> int:
    """The largest power of two ≤ ``block`` dividing n (n a multiple of 128)."""
    while n % block:
        block //= 2
    return block


def _splash_call(q_len: int, kv_len: int, block: int) -> object:
    """Splash over q [h, q_len, d] at positions [kv_len − q_len, kv_len) against keys
    [0, kv_len): causal with offset kv_len − q_len."""
    mask = masks.CausalMask((q_len, kv_len), offset=kv_len - q_len)
    bq, bkv = _fit(block, q_len), _fit(block, kv_len)
    sizes = splash.BlockSizes(
        block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv, use_fused_bwd_kernel=True,
    )  # fmt: skip
    return splash.make_splash_mha(
        masks.MultiHeadMask([mask] * ab.HEADS), block_sizes=sizes, head_shards=1, q_seq_shards=1,
        interpret=jax.default_backend() != "tpu",
    )  # fmt: skip


def gathered_share_step(tokens: int, ring: int, device: int, block: int) -> ab.Step:
    """Device ``device``'s share with K, V whole (natural order): q [b, T/n, h, d] = its two
    zigzag chunks; one splash call per chunk."""
    c = tokens // (2 * ring)
    chunks = (device, 2 * ring - 1 - device)
    calls = [_splash_call(c, (r + 1) * c, block) for r in chunks]

    def run(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        outs = []
        for i, (r, call) in enumerate(zip(chunks, calls, strict=True)):
            qi = q[:, i * c : (i + 1) * c] * q.shape[-1] ** -0.5
            ki, vi = k[:, : (r + 1) * c], v[:, : (r + 1) * c]
            qh, kh, vh = (jnp.swapaxes(x, 1, 2) for x in (qi, ki, vi))
            outs.append(jnp.swapaxes(jax.vmap(call)(qh, kh, vh), 1, 2))
        return jnp.concatenate(outs, axis=1)

    return run


def _row(tokens: int, ring: int, name: str, step: ab.Step, args: tuple, share: float) -> dict:
    try:
        result = ab.timed_vjp(step, args, steps=5, warmup=1)
    except Exception as err:  # out of VMEM, a shape splash refuses: the row says so
        return {"tokens": tokens, "ring": ring, "contender": name, "error": str(err)[:200]}
    work = ab._flops(tokens, True) * share
    row = {"tokens": tokens, "ring": ring, "contender": name, "ms": result["ms"],
           "tflops": work / result["ms"] / 1e9, "temp_gb": result["temp_gb"]}  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    rows = []
    for tokens, ring in CASES:
        keys = jax.random.split(jax.random.key(tokens), 3)
        shape = (ab.BATCH, tokens, ab.HEADS, ab.HEAD_DIM)
        qkv = tuple(jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
        rows.append(_row(tokens, ring, "splash", ab.splash_step(tokens, True, ab.HEADS), qkv, 1))
        t = tokens // ring
        zq, zk, zv = (layouts.to_layout(x, ring, "zigzag") for x in qkv)
        for block in RING_BLOCKS:
            kernel_lib.BLOCK = block
            kernel_lib._kernel.cache_clear()
            step = ab.zigzag_device_step(ring, 0, tokens)
            rows.append(_row(tokens, ring, f"ring hops b{block}", step, (zq[:, :t], zk, zv),
                             1 / ring))  # fmt: skip
        kernel_lib.BLOCK = 1024
        for block in GATHER_BLOCKS:
            for d in (0, ring - 1):
                step = gathered_share_step(tokens, ring, d, block)
                rows.append(_row(tokens, ring, f"gathered {d}/{ring} b{block}", step,
                                 (zq[:, d * t : (d + 1) * t], *qkv[1:]), 1 / ring))  # fmt: skip
    with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "tpu_allgather_cp.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
    splash_tf = {
        (r["tokens"], r["ring"]): r.get("tflops") for r in rows if r["contender"] == "splash"
    }
    for r in rows:
        ref = splash_tf.get((r["tokens"], r["ring"]))
        ratio = f"{r['tflops'] / ref:.2f}" if ref and r.get("tflops") else "-"
        print(f"{r['tokens']:>6} n={r['ring']} {r['contender']:<22} "
              f"{r.get('ms', float('nan')):>8.2f} ms {r.get('tflops') or 0:>6.1f} TF/s "
              f"x{ratio} {r.get('error', '')}")  # fmt: skip


if __name__ == "__main__":
    main()
