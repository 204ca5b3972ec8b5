"""Sweeps on a TPU host beyond ``shardkit bench --attention`` (``run.attention_bench``, which
gives the main table): the Pallas block size per length, and the local core's jnp/Pallas
crossover that ``kernel="auto"`` follows. Run with ``bash docs/measure/tpu_attention.sh``.

    python docs/measure/tpu_attention.py --blocks 512,1024,2048 [--tokens 4096,...]
    python docs/measure/tpu_attention.py --crossover --tokens 256,512,1024,2048,4096

--blocks: ``shardkit bench --attention``'s rows (splash and shardkit's Pallas path, both at the
block size) once per block size (``kernels.attention.BLOCK``). --crossover: ``attention_local``
on each kernel at ViT-like shapes (b 8, 12 heads × 64, bf16), forward + backward.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import shardkit.kernels.attention as kernel_lib
from shardkit.parallel.sequence import attention_local
from shardkit.run import attention_bench


def crossover(tokens: list[int], reps: int) -> list[dict]:
    rows = []
    for t in tokens:
        keys = jax.random.split(jax.random.key(t), 3)
        args = tuple(jax.random.normal(key, (8, t, 12, 64), jnp.bfloat16) for key in keys)
        for causal in (False, True):
            for kernel in ("jnp", "pallas"):

                def local(q, k, v, kernel=kernel, causal=causal):
                    return attention_local(q, k, v, causal=causal, kernel=kernel)[0]

                result = attention_bench.timed_vjp(local, args, reps, warmup=1)
                result.pop("out")
                row = {"tokens": t, "causal": causal, "contender": f"local {kernel}", **result}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def blocks(tokens: list[int], sizes: list[int], reps: int) -> list[dict]:
    rows = []
    for size in sizes:
        kernel_lib.BLOCK = size
        kernel_lib._kernel.cache_clear()
        result = attention_bench.run(tokens, ["pallas"], steps=reps, warmup=1, progress=print)
        for row in result["rows"]:
            if row["contender"] != "xla":
                rows.append({**row, "contender": f"{row['contender']} b{size}"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="4096,8192,16384,32768")
    parser.add_argument("--blocks", default="512,1024,2048")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--crossover", action="store_true", help="the local core, jnp vs pallas")
    opts = parser.parse_args()
    tokens = [int(t) for t in opts.tokens.split(",")]
    if opts.crossover:
        name, rows = "tpu_attention_crossover.json", crossover(tokens, opts.reps)
    else:
        sizes = [int(b) for b in opts.blocks.split(",")]
        name, rows = "tpu_attention_blocks.json", blocks(tokens, sizes, opts.reps)
    with open(os.path.join(os.environ.get("OUT", "/tmp/out"), name), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
