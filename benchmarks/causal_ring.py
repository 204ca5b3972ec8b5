"""Causal ring attention: work per device from the schedule, and step time, per token layout.

    python benchmarks/causal_ring.py [--devices 4] [--tokens 4096] [--repeats 5]

Per device: the (query, key) pairs ``attention_ring`` computes (``sequence.ring_work``, from
its tiles and causal skips) as a fraction of a bidirectional ring's n·t². Step time: forward +
backward of the ring under ``jit`` on a ``seq`` mesh of CPU devices, median of interleaved
repeats, as a ratio to the bidirectional ring measured in the same run. On one CPU host the
devices share its cores, so step time follows the TOTAL work, not the busiest device's; on
accelerators it follows the busiest device (the balance column).
"""

import argparse
import statistics
import time

import shardkit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=4)
parser.add_argument("--tokens", type=int, default=4096)
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()
shardkit.set_cpu_devices(args.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from shardkit.parallel.sequence import ring_work, sharded_attention  # noqa: E402

n, tokens = args.devices, args.tokens
mesh = shardkit.make_mesh({"seq": n})
shape = (1, tokens, 4, 32)
q, k, v = (jax.random.normal(jax.random.key(i), shape) for i in range(3))
cases = {"bidirectional": (False, "contiguous")} | {
    f"causal {layout}": (True, layout) for layout in ("contiguous", "zigzag", "striped")
}


def step_fn(causal: bool, layout: str):
    def loss(q, k, v):
        out, _ = sharded_attention(q, k, v, mesh, "ring", causal=causal, layout=layout)
        return jnp.sum(out * out)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


fns = {name: step_fn(*case) for name, case in cases.items()}
for fn in fns.values():
    jax.block_until_ready(fn(q, k, v))  # compile
times: dict[str, list[float]] = {name: [] for name in fns}
for _ in range(args.repeats):
    for name, fn in fns.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        times[name].append(time.perf_counter() - start)
base = statistics.median(times["bidirectional"])
full = n * (tokens // n) ** 2
print(f"ring over {n} devices, {tokens} tokens ({tokens // n} per device), b=1, h=4, k=32")
print(f"{'case':<20}{'work per device (× bidirectional)':<40}{'balance':>9}{'step time':>11}")
for name, (causal, layout) in cases.items():
    work = [w / full for w in ring_work(layout, n, tokens // n, causal)]
    per = " ".join(f"{w:.2f}" for w in work)
    ratio = statistics.median(times[name]) / base
    print(f"{name:<20}{per:<40}{max(work) / min(work):>8.2f}×{ratio:>10.2f}×")
