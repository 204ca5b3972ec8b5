"""Does a libtpu flag speed up the batch-32 step on one v5e? (docs/performance.md)

    python3 docs/measure/tpu_flags_probe.py [--batch 32] [--steps 20]   # on a TPU host

The sharded ViT-B/16 (bf16, ``--layers list --precision big_vision``, ``Plan({"data": 1})``:
the step ``bench --chip`` measures at 1,140.9 img/s) compiled once per flag set with
``compile(compiler_options=...)``, each run from the same params: the median waited-for
step and back-to-back steps, in img/s. The flag sets aim at what the per-op profile left
outside the matmuls (``tpu_v5e_profile_list_b32.txt``: 2.1 ms of 25.9 in 1,350 copy-dones,
memory-space assignment's copies between HBM and the chip's vector memory): the scoped
vector-memory limit, MSA's copy ratio, read-write-buffer fusion, and MaxText's v5e set.
"""

import argparse
import dataclasses
import statistics
import time

import jax
import numpy as np

import vit_ref
from shardkit.mesh import Plan
from shardkit.models.vit import ShardedViT
from shardkit.run import bench, target
from shardkit.run.verify import make_batch

FLAG_SETS: dict[str, dict[str, str]] = {
    "default": {},
    "scoped vmem 96 MiB": {"xla_tpu_scoped_vmem_limit_kib": "98304"},
    "scoped vmem 64 MiB": {"xla_tpu_scoped_vmem_limit_kib": "65536"},
    "msa copy ratio 0.5": {"xla_tpu_msa_inefficient_use_to_copy_ratio": "0.5"},
    "no rwb fusion": {"xla_tpu_rwb_fusion": "false"},
    "maxtext": dict(target.TPU_FLAGS["maxtext"]),
}


def timed(step, state, steps: int) -> tuple[float, float]:
    """(median waited-for step, back-to-back step) in seconds; ``state`` is donated."""
    params, opt, *data = state
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, opt, metrics = step(params, opt, *data)
        jax.block_until_ready((params, opt, metrics))
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(steps):
        params, opt, metrics = step(params, opt, *data)
    jax.block_until_ready((params, opt, metrics))
    return statistics.median(times[2:]), (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variant", default="B/16")
    args = parser.parse_args()
    cfg = dataclasses.replace(
        vit_ref.variant(args.variant), dtype="bfloat16", precision="big_vision"
    )
    model = ShardedViT(cfg, Plan({"data": 1}, layers="list"))
    optimizer = bench.default_optimizer()
    params = vit_ref.init(jax.random.key(0), cfg)
    data = model.shard_batch(*(np.asarray(a) for a in make_batch(cfg, args.batch)))
    fn = model.train_step(optimizer)
    kind = jax.devices()[0].device_kind
    print(f"{kind}, ViT-{args.variant} bf16 batch {args.batch}, per-layer params")
    print(f"{'flags':<22}{'compile s':>10}{'img/s':>9}{'b2b img/s':>11}{'temp GB':>9}")
    for name, flags in FLAG_SETS.items():
        placed = model.shard(params)
        state = (placed, model.init_opt_state(optimizer, placed), *data)
        t0 = time.perf_counter()
        try:
            step = fn.lower(*state).compile(compiler_options=flags or None)
        except Exception as err:  # an unknown flag: say so, go on
            print(f"{name:<22} refused: {str(err).splitlines()[0][:80]}", flush=True)
            continue
        compile_s = time.perf_counter() - t0
        waited, b2b = timed(step, state, args.steps)
        temp = step.memory_analysis().temp_size_in_bytes / 1e9
        print(f"{name:<22}{compile_s:>10.1f}{args.batch / waited:>9.1f}"
              f"{args.batch / b2b:>11.1f}{temp:>9.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
