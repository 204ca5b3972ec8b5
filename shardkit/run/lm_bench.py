"""``shardkit bench --model gpt | moe-gpt``: the decoder's hand-sharded step vs XLA's automatic
partitioner vs one device.

For each plan (``run.lm``'s ``PLANS``, ``MOE_PLANS`` with experts, or the one given), on the same
params and batch, in one process, three contenders take the same clipped AdamW step:

  shardkit    ``models.gpt.sharded_gpt``'s train step (every collective written in shard_map);
  auto        the twin (``models.gpt.twin_loss``) under ``jax.jit``, params, optimizer state and
              batch placed with the plan's ``NamedSharding``s, the residual stream constrained
              to split tokens over seq, and the MoE blocks in GShard's form (``gshard_moe``):
              what a GSPMD user writes; XLA's partitioner places every collective;
  one device  the auto program on the first device, nothing constrained.

The three compute the same function: the same routing groups (one per data × expert × seq
device), capacities and drops — except with seq, where the auto groups hold the natural token
order and the hand plan's its layout's, so drops may differ; the first step's losses are in the
row. Timing, bytes, memory and MFU as in ``run.bench``, whose table and plot print the result.
The model is ``models.gpt``'s decoder widened (``bench_config``) so that matmuls, not dispatch,
dominate a CPU step. The twin's layer loop is unrolled for auto and one device: with the
``lax.scan``, XLA:CPU deadlocked the partitioned step now and then (its device threads waiting
in different collectives; docs/design.md), unrolled it ran every time tried.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_ref
from shardkit.comm.ledger import ledger_of
from shardkit.comm.report import Report
from shardkit.mesh import format_mesh
from shardkit.models import gpt
from shardkit.models.gpt.model import ALPHA, BETA
from shardkit.models.sharded import ShardedModel
from shardkit.parallel import data as dp
from shardkit.parallel import moe
from shardkit.run import bench, lm

CLIP = 1.0  # the global-norm clip of every contender's step (the cost model's step)
GROUPS = P(("data", "expert", "seq"))  # [G, ...]: a routing group per device
TOKENS = P(("data", "expert"), "seq")  # [B, T, ...]
COLUMNS = [*bench.COLUMNS[:2], ("loss", "shardkit_loss", "{:.4f}"),
           ("auto loss", "auto_loss", "{:.4f}"), *bench.COLUMNS[2:]]  # fmt: skip


def bench_config(cfg: gpt.GPTConfig) -> gpt.GPTConfig:
    """The decoder at width 256 (MLP 4× the default's), 128 tokens: matmul-bound on a CPU."""
    return dataclasses.replace(cfg, dim=256, mlp=4 * cfg.mlp, tokens=128)


def gshard_moe(
    e: moe.MoE,
    groups: tuple[int, int],
    pin: Callable[..., Any],
    weights: tuple[float, float] = (ALPHA, BETA),
) -> Any:
    """A MoE layer as a GSPMD user writes it (GShard's recipe): tokens in routing groups
    [G, n, d] (``groups``: batch blocks × token blocks, as ``moe_ref.to_groups``), routed,
    slotted and packed per group (vmapped), the buffers [G, E, C, d] pinned to split E over
    expert for the experts and pinned back to the groups for the combine; ``pin(array,
    spec)`` is the sharding constraint (identity on one device). ``block(z, m)`` returns the
    output and the load-balance and z-losses weighted by ``weights``."""

    def block(z: jax.Array, m: Any) -> tuple[jax.Array, jax.Array]:
        b, t, _ = z.shape
        zg = pin(moe_ref.to_groups(z, groups), GROUPS)
        capacity = e.capacity(zg.shape[1])
        routing = jax.vmap(lambda g: moe.route(g, m["router"], e))(zg)
        slots = jax.vmap(lambda r: moe.assign_slots(r, e, capacity))(routing)
        buffers = jax.vmap(lambda g, r, s: moe.dispatch(g, r, s, capacity))(zg, routing, slots)
        buffers = pin(buffers, P(("data", "seq"), "expert"))  # to the experts
        gate = jnp.einsum("gecd,edf->gecf", buffers, m["gate"])
        up = jnp.einsum("gecd,edf->gecf", buffers, m["up"])
        y = pin(jnp.einsum("gecf,efd->gecd", jax.nn.silu(gate) * up, m["down"]), GROUPS)
        out = moe_ref.from_groups(jax.vmap(moe.combine)(y, routing, slots), groups, z.shape)
        ids = moe_ref.from_groups(routing.experts, groups, (b, t, e.top_k))
        probs = moe_ref.from_groups(routing.probs, groups, (b, t, e.experts))
        if e.aux == "batch":
            balance = moe_ref.load_balance(ids.reshape(b * t, -1), probs.reshape(b * t, -1), e)
        else:
            balance = jnp.mean(jax.vmap(lambda i, q: moe_ref.load_balance(i, q, e))(ids, probs))
        router_z = jnp.mean(jax.nn.logsumexp(routing.logits, axis=-1) ** 2)
        return out, weights[0] * balance + weights[1] * router_z

    return block


def auto_loss(cfg: gpt.GPTConfig, p: gpt.GPTPlan, mesh: Any | None) -> Callable[..., Any]:
    """The twin's loss with the partitioner's hooks for ``mesh`` (None: one device)."""

    def pin(x: jax.Array, spec: P) -> jax.Array:
        return x if mesh is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    groups = (p.mesh["data"] * p.mesh["expert"], p.mesh["seq"])
    hooks: dict[str, Any] = {"unroll": True}  # XLA:CPU deadlocked the partitioned scan
    if cfg.experts is not None:
        hooks["moe_block"] = gshard_moe(cfg.experts, groups, pin)
    if p.mesh["seq"] > 1 and mesh is not None:
        hooks["constrain"] = lambda h: pin(h, TOKENS)

    def loss(params: Any, x: jax.Array, y: jax.Array, *docs: jax.Array) -> jax.Array:
        return gpt.twin_loss(params, x, y, cfg, seg=docs[0] if docs else None, **hooks)

    return loss


def auto_step(loss: Callable[..., Any], optimizer: optax.GradientTransformation) -> Any:
    """value_and_grad, clipping to ``CLIP`` by the global norm, the optimizer; jitted, donating
    params and state (the caller's placement decides the shardings)."""

    def step(params: Any, state: Any, *batch: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(params, *batch)
        norm = optax.tree.norm(grads)
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, CLIP / norm), grads)
        params, state = dp.optax_update(optimizer, grads, state, params)
        return params, state, {"loss": value}

    return step


def _copied(tree: Any, shardings: Any) -> Any:
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)(tree)


def _contender(step: Any, params: Any, state: Any, batch: Sequence[Any], mesh: Any) -> Any:
    compiled, seconds, program = bench.compile_timed(step, params, state, *batch)
    led = ledger_of(compiled, mesh) if mesh is not None else None
    return bench.Contender(compiled, params, state, tuple(batch), seconds, program, led)


def hand_contender(
    cfg: gpt.GPTConfig, p: gpt.GPTPlan, batch: int, params: Any, data: Any
) -> tuple[bench.Contender, ShardedModel]:
    """The hand-sharded decoder's clipped AdamW step on ``p``, compiled, its params, state and
    batch placed; and the model."""
    model = lm.build(cfg, p, batch)
    optimizer = optax.adamw(1e-3)
    placed = model.shard(params)
    state = model.init_opt_state(optimizer, placed)
    hand = model.train_step(optimizer, clip_norm=CLIP)
    ours = _contender(hand, placed, state, model.shard_batch(*lm.ordered(p, *data)), model.mesh)
    return ours, model


def contenders(cfg: gpt.GPTConfig, p: gpt.GPTPlan, batch: int, params: Any, data: Any):
    """(shardkit, auto, one device), compiled, their params and state placed."""
    ours, model = hand_contender(cfg, p, batch, params, data)
    optimizer = optax.adamw(1e-3)
    shardings = jax.tree.map(lambda a: a.sharding, (ours.params, ours.opt_state))
    step = auto_step(auto_loss(cfg, p, model.mesh), optimizer)
    auto_params, auto_state = _copied((ours.params, ours.opt_state), shardings)
    tokens = NamedSharding(model.mesh, TOKENS)
    batch_auto = [jax.device_put(a, tokens) for a in data]
    jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=(*shardings, None))
    auto = _contender(jitted, auto_params, auto_state, batch_auto, model.mesh)
    device = jax.devices()[0]
    one = jax.device_put(params, device)  # host arrays: fresh buffers, donated below
    single_step = jax.jit(auto_step(auto_loss(cfg, p, None), optimizer), donate_argnums=(0, 1))
    single = _contender(single_step, one, jax.jit(optimizer.init)(one),
                        [jax.device_put(a, device) for a in data], None)  # fmt: skip
    for c in (ours, auto, single):  # nothing still in flight when the first step starts
        jax.block_until_ready((c.params, c.opt_state, c.batch))
    return ours, auto, single


def _first_loss(c: bench.Contender) -> float:
    """One untimed step (it also warms up); the loss it reports."""
    c.run()
    return float(c.metrics["loss"])


def bench_plan(
    cfg: gpt.GPTConfig, name: str, p: gpt.GPTPlan, batch: int, steps: int, warmup: int,
    params: Any, data: Any, peak: float,
) -> dict[str, Any]:  # fmt: skip
    """One plan's row: compiled, one untimed step each, ``warmup`` more, ``steps`` timed
    rounds of the three in turn."""
    ours, auto, single = contenders(cfg, p, batch, params, data)
    losses = {k: _first_loss(c) for k, c in (("shardkit", ours), ("auto", auto),
                                             ("single_device", single))}  # fmt: skip
    for round_ in range(warmup + steps):
        for c in (ours, auto, single):
            seconds = c.run()
            if round_ >= warmup:
                c.times.append(seconds)
    return {"strategy": name, "mesh": format_mesh(p.mesh),
            **{f"{k}_loss": v for k, v in losses.items()},
            **_values(cfg, p, batch, ours, auto, single, peak), "auto_error": None}  # fmt: skip


def _values(
    cfg: gpt.GPTConfig, p: gpt.GPTPlan, batch: int, ours: bench.Contender,
    auto: bench.Contender, single: bench.Contender, peak: float,
) -> dict[str, Any]:  # fmt: skip
    assert ours.ledger is not None and auto.ledger is not None
    local = sum(leaf.addressable_shards[0].data.size for leaf in jax.tree.leaves(ours.params))
    expectation = gpt.expectation(cfg, p, batch, local)
    report = None if expectation is None else Report(ours.ledger, expectation)
    flops = gpt.model_flops(cfg, batch)
    v: dict[str, Any] = {
        **bench.time_stats("shardkit", ours.times),
        **bench.time_stats("auto", auto.times),
        **bench.time_stats("single_device", single.times),
        "shardkit_bytes_sent": report.measured_bytes_sent if report else None,
        "expected_bytes_sent": report.expected_bytes_sent if report else None,
        "contract_ok": report.contract_ok if report else None,
        "auto_bytes_sent": auto.ledger.total_bytes_sent(),
        **bench.memory_stats("shardkit", ours.ledger),
        **bench.memory_stats("auto", auto.ledger),
        "shardkit_compile_s": ours.compile_s,
        "auto_compile_s": auto.compile_s,
        "model_flops": flops,
    }
    if report is None:  # no cost model (the Ulysses core): what the ledger reads
        v["shardkit_bytes_sent"] = ours.ledger.total_bytes_sent()
    v["ratio_vs_auto"] = v["shardkit_step_s"] / v["auto_step_s"]
    v["ratio_vs_single_device"] = v["shardkit_step_s"] / v["single_device_step_s"]
    for who in ("shardkit", "auto", "single_device"):
        v[f"{who}_mfu"] = flops / v[f"{who}_step_s"] / peak
    return v


def run(
    cfg: gpt.GPTConfig,
    plans: dict[str, gpt.GPTPlan],
    batch: int,
    steps: int = 5,
    warmup: int = 1,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Benchmarks every plan (all checked first); ``{"rows": [...], ...}`` as ``run.bench``."""
    for p in plans.values():
        gpt.check_plan(cfg, p, batch)
    peak = bench.matmul_peak()
    params = jax.tree.map(np.asarray, gpt.init(0, cfg))  # host: every placement copies
    data = tuple(np.asarray(a) for a in lm.sample(cfg, batch))
    rows = []
    for name, p in plans.items():
        progress(f"{name} ({p.name})")
        rows.append(bench_plan(cfg, name, p, batch, steps, warmup, params, data, peak))
    return {**lm.describe(cfg), "batch": batch, "devices": jax.device_count(), "steps": steps,
            "warmup": warmup, "peak_flops_per_s": peak, "rows": rows}  # fmt: skip


def format_table(result: dict[str, Any], markdown: bool = False) -> str:
    """``run.bench``'s table with the first step's losses."""
    return bench.format_table(result, markdown, columns=COLUMNS)
