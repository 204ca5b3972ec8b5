"""Expert parallelism by hand (all-to-all, ring of experts) vs XLA's partitioner on the same
MoE block: collectives, bytes sent per device and step time, side by side.

    python benchmarks/moe_ep.py [--mesh data=2,expert=4] [--batch 16] [--tokens 64]
                                [--dim 64] [--hidden 128] [--repeats 7]

The block of ``examples/moe_block.py`` (projection, MoE of 8 SwiGLU experts, top-2, capacity
factor 1.25, head; squared error + load-balance + z-loss), one clipped-free AdamW step:

  all_to_all  ``ShardedModel`` + ``moe.moe_layer``: the hand-written shard_map step;
  ring        the same with ``dispatch_by="ring"`` (all-gather + reduce-scatter);
  XLA auto    what a GSPMD user writes (GShard's recipe): the same routing, slots and
              dispatch, vmapped over the token groups [G, n, d] (G over data × expert), the
              buffers [G, E, C, d] constrained to split E over ``expert`` for the experts and
              back to G for the combine; params and batch placed like the hand plan; XLA
              inserts every collective.

All three compute the same function (the same groups, capacities and drops); the losses are
printed to show it. Step times are medians of interleaved repeats on this machine's CPU
devices, as a ratio to XLA auto.
"""

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import shardkit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--mesh", default="data=2,expert=4")
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--tokens", type=int, default=64)
parser.add_argument("--dim", type=int, default=64)
parser.add_argument("--hidden", type=int, default=128)
parser.add_argument("--repeats", type=int, default=7)
args = parser.parse_args()
shardkit.set_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardkit import ledger, moe  # noqa: E402
from shardkit.parallel import data as dp  # noqa: E402
from shardkit.run.lm_bench import gshard_moe  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "moe_block", Path(__file__).resolve().parents[1] / "examples" / "moe_block.py"
)
block = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(block)

CFG = moe.MoE(8, 2, 1.25)


def auto_loss(p, x, y, mesh):
    """The block as a GSPMD user writes it: routing per token group, layouts by constraint
    (``run.lm_bench.gshard_moe``, the decoder bench's MoE layer)."""
    pin = lambda a, spec: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))  # noqa: E731
    layer = gshard_moe(CFG, (mesh.shape["data"] * mesh.shape["expert"], 1), pin,
                       (block.ALPHA, block.BETA))  # fmt: skip
    h = jnp.einsum("btd,de->bte", x, p["proj"])
    out, aux = layer(h, p["moe"])
    pred = jnp.einsum("btd,de->bte", h + out, p["head"])
    return jnp.mean((pred - y) ** 2) + aux


def auto_step(model, optimizer):
    """The XLA-partitioned step: params, state and batch placed like the hand plan's."""
    shard = model.sharding

    def step(p, state, x, y):
        loss, grads = jax.value_and_grad(auto_loss)(p, x, y, model.mesh)
        p, state = dp.optax_update(optimizer, grads, state, p)
        return p, state, {"loss": loss}

    params = jax.tree.map(shard, model.specs, is_leaf=lambda s: isinstance(s, P))
    return jax.jit(step, out_shardings=(params, None, shard(P())))


def build(name, mesh, optimizer):
    """(compiled step, its arguments, ledger) for one implementation."""
    model = block.sharded(mesh, CFG, dispatch_by="ring" if name == "ring" else "all_to_all")
    params = model.shard(block.init(0, CFG.experts, args.dim, args.hidden))
    state = model.init_opt_state(optimizer, params)
    batch = model.shard_batch(*block.batch(1, args.batch, args.tokens, args.dim))
    if name == "XLA auto":
        step = auto_step(model, optimizer)
    else:
        step = jax.jit(model.train_step(optimizer), donate_argnums=())  # inputs kept: repeats
    compiled = step.lower(params, state, *batch).compile()
    led = ledger.measure(step, params, state, *batch, mesh=mesh)
    return compiled, (params, state, *batch), led


def main() -> None:
    mesh = shardkit.make_mesh(shardkit.parse_mesh(args.mesh))
    optimizer = optax.adamw(1e-3)
    runs = {name: build(name, mesh, optimizer) for name in ("XLA auto", "all_to_all", "ring")}
    losses = {name: float(c(*a)[2]["loss"]) for name, (c, a, _) in runs.items()}  # also warms
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (compiled, step_args, _) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled(*step_args))
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["XLA auto"])
    print(f"MoE block: {CFG.experts} experts, top-{CFG.top_k}, capacity factor "
          f"{CFG.capacity_factor}, d={args.dim}, F={args.hidden}, batch {args.batch} × "
          f"{args.tokens} tokens; {shardkit.format_mesh(dict(mesh.shape))}")  # fmt: skip
    print(f"{'step':<12}{'collectives':>12}{'bytes sent':>14}{'loss':>12}{'step ms':>10}"
          f"{'vs auto':>9}  what")  # fmt: skip
    for name, (_, _, led) in runs.items():
        kinds = sorted({f"{k} {','.join(a)}" for (k, a), t in led.summary().items() if a})
        ms = statistics.median(times[name]) * 1e3
        print(f"{name:<12}{sum(t.count for t in led.summary().values()):>12}"
              f"{led.total_bytes_sent():>14,.0f}{losses[name]:>12.6f}{ms:>10.1f}"
              f"{ms / (base * 1e3):>8.2f}×  {'; '.join(kinds)}")  # fmt: skip


if __name__ == "__main__":
    main()
