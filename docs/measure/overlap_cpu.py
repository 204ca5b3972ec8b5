"""``--overlap`` on and off, side by side, on CPU devices: the issue's "not slower" check.

    python docs/measure/overlap_cpu.py            # 8 CPU devices; bench's default ViT, batch 32

A CPU has no asynchronous collectives, so the overlapped forms cannot be faster there; they
must not be slower either. For each plan the step with and without ``Plan.overlap`` is
compiled (``run.bench.shardkit_contender``: the donated train step ``shardkit bench`` times)
and the two are timed in interleaved rounds in one process, so they meet the same machine
load; the median ratio is printed with each side's median. Results:
docs/measure/results/overlap_cpu.txt, docs/strategies/overlap.md ("On CPU").
"""

import dataclasses
import statistics
import sys

import numpy as np

import shardkit

shardkit.set_cpu_devices(8)

import jax  # noqa: E402

import vit_ref  # noqa: E402
from shardkit.mesh import Plan  # noqa: E402
from shardkit.run import bench  # noqa: E402
from shardkit.run.verify import make_batch  # noqa: E402

PLANS = {
    "Megatron-SP, data=2,model=4": Plan({"data": 2, "model": 4}, sp="megatron"),
    "Megatron-SP unrolled, data=2,model=4": Plan(
        {"data": 2, "model": 4}, sp="megatron", layers="unrolled"
    ),
    "FSDP, data=8": Plan({"data": 8}, fsdp=True),
    "FSDP×TP, data=4,model=2": Plan({"data": 4, "model": 2}, fsdp=True),
    "DP, data=8": Plan({"data": 8}),
    "DP×TP, data=4,model=2": Plan({"data": 4, "model": 2}),
    "TP, model=8": Plan({"model": 8}),
    "ZeRO-2, data=8": Plan({"data": 8}, zero=2),
}
ROUNDS, WARMUP = 12, 3


def main() -> None:
    cfg = vit_ref.ViTConfig(**bench.DEFAULT_MODEL, head_zeroinit=False)
    params = vit_ref.init(jax.random.key(0), cfg)
    data = tuple(np.asarray(a) for a in make_batch(cfg, bench.DEFAULT_BATCH))
    print(f"ViT {cfg.depth} layers dim {cfg.dim}, batch {bench.DEFAULT_BATCH}, "
          f"{jax.device_count()} CPU devices; median of {ROUNDS} interleaved rounds "
          f"after {WARMUP}")  # fmt: skip
    print(f"{'plan':<40} {'off ms':>8} {'on ms':>8} {'on/off':>7}")
    for name, plan in PLANS.items():
        sides = [
            bench.shardkit_contender(cfg, dataclasses.replace(plan, overlap=on), params, data)
            for on in (False, True)
        ]
        for round_ in range(WARMUP + ROUNDS):
            for side in sides:
                seconds = side.run()
                if round_ >= WARMUP:
                    side.times.append(seconds)
        off, on = (statistics.median(side.times) for side in sides)
        ratios = [b / a for a, b in zip(sides[0].times, sides[1].times, strict=True)]
        print(f"{name:<40} {off * 1e3:>8.1f} {on * 1e3:>8.1f} "
              f"{statistics.median(ratios):>7.3f}", flush=True)  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
