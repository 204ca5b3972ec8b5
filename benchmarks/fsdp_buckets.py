"""FSDP gathers in buckets vs one op per leaf: ops and step time, side by side.

    python benchmarks/fsdp_buckets.py [--mesh data=8] [--depth 4] [--dim 256] [--repeats 7]

Compiles the sharded ViT's train step twice on the same plan: with ``data.fsdp_gather``'s
buckets (the default: one flat buffer per group of leaves) and leaf by leaf
(``bucket=False``). Prints, for each, the all-gather and reduce-scatter ops over ``data`` per
step, the bytes sent per device (identical), temp memory, and the median step time of
interleaved repeats as a ratio to the per-leaf step.
"""

import argparse
import functools
import statistics
import time

import shardkit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--mesh", default="data=8")
parser.add_argument("--remat", action="store_true")
parser.add_argument("--depth", type=int, default=4)
parser.add_argument("--dim", type=int, default=256)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--repeats", type=int, default=7)
args = parser.parse_args()
shardkit.set_cpu_devices(8)

import jax  # noqa: E402

import vit_ref  # noqa: E402
from shardkit import ledger  # noqa: E402
from shardkit.parallel import data as dp  # noqa: E402
from shardkit.run import verify  # noqa: E402

cfg = vit_ref.ViTConfig(image=32, patch=4, classes=10, dim=args.dim, depth=args.depth, heads=4,
                        mlp_dim=4 * args.dim, pool="tok")  # fmt: skip
plan = shardkit.Plan(shardkit.parse_mesh(args.mesh), fsdp=True, remat=args.remat)
optimizer = verify.verify_optimizer()
bucketed_gather = dp.fsdp_gather


def build(bucket: bool):
    """(model, step, args) with fsdp_gather's bucketing switched for this compile."""
    dp.fsdp_gather = functools.partial(bucketed_gather, bucket=bucket)
    model = shardkit.ShardedViT(cfg, plan)
    params = model.shard(vit_ref.init(jax.random.key(0), cfg))
    state = model.init_opt_state(optimizer, params)
    batch = model.shard_batch(*verify.make_batch(cfg, args.batch))
    step = jax.jit(model.train_step(optimizer), donate_argnums=())  # keep inputs for repeats
    compiled = step.lower(params, state, *batch).compile()
    led = ledger.measure(step, params, state, *batch, mesh=model.mesh)
    dp.fsdp_gather = bucketed_gather
    return compiled, (params, state, *batch), led


runs = {"per leaf": build(False), "bucketed": build(True)}
times: dict[str, list[float]] = {name: [] for name in runs}
for compiled, step_args, _ in runs.values():
    jax.block_until_ready(compiled(*step_args))  # warm
for _ in range(args.repeats):
    for name, (compiled, step_args, _) in runs.items():
        start = time.perf_counter()
        jax.block_until_ready(compiled(*step_args))
        times[name].append(time.perf_counter() - start)

base = statistics.median(times["per leaf"])
print(f"ViT dim={cfg.dim} depth={cfg.depth} mlp={cfg.mlp_dim}, batch {args.batch}, "
      f"{shardkit.format_mesh(plan.mesh)} fsdp remat={plan.remat}")  # fmt: skip
print(f"{'gathers':<10}{'AG ops':>8}{'RS ops':>8}{'bytes sent':>14}{'temp MiB':>10}"
      f"{'step ms':>10}{'ratio':>8}")  # fmt: skip
for name, (compiled, _, led) in runs.items():
    summary = led.summary()
    ag = summary[("all-gather", ("data",))].count
    rs = summary[("reduce-scatter", ("data",))].count
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
    ms = statistics.median(times[name]) * 1e3
    print(f"{name:<10}{ag:>8}{rs:>8}{led.total_bytes_sent():>14,.0f}{temp:>10.2f}"
          f"{ms:>10.1f}{ms / (base * 1e3):>7.2f}×")  # fmt: skip
