"""Measured vs expected: the communication contract of one (model, plan, batch), ready to print.

``inspect(cfg, plan, batch)`` builds a ``ShardedViT``, compiles its full train step (forward,
backward and AdamW update; compiled, never run), measures every collective with
``shardkit.ledger`` and sets them beside ``shardkit.cost``'s analytic expectation, per (kind,
axes): a :class:`Report` with ``to_json()`` (the ``shardkit inspect --json`` object),
``format()`` (a table) and ``contract_ok`` (counts equal, bytes within 1%).

``auto_train_step`` / ``measure_auto`` compile the same model and step with XLA's automatic
partitioner instead (``jax.jit`` with ``NamedSharding`` params, no ``shard_map``), for the
comparison DESIGN.md asks of the docs and ``shardkit bench``.

Arguments are abstract (``jax.ShapeDtypeStruct`` carrying the shardings ``ShardedViT.shard``
and ``init_opt_state`` would give), so no params are drawn and no array is allocated: the
compiled program depends only on shapes, dtypes and shardings.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vit_ref
from shardkit.comm import cost
from shardkit.comm.ledger import KINDS, Ledger, Tally, measure, shown_patterns
from shardkit.mesh import Plan, format_mesh, make_mesh
from shardkit.models.sharded import opt_state_layout
from shardkit.models.vit import ShardedViT, check_plan, param_specs, schedule, state_specs
from shardkit.parallel import pipeline
from shardkit.parallel.schedules import Schedule
from vit_ref.train import apply_optimizer

Key = tuple[str, tuple[str, ...]]
RTOL = 0.01  # bytes may differ by 1% (the contract); counts must be equal


@dataclasses.dataclass(frozen=True)
class Row:
    """One (kind, axes): measured and expected executions per step and bytes sent per device."""

    kind: str
    axes: tuple[str, ...]
    count: int
    bytes_sent: float
    expected_count: int
    expected_bytes_sent: float
    exact: bool = True  # False: the expectation is an upper bound (``Expectation.exact``)
    # pattern -> ops and bytes, measured and expected (``ledger.Collective.pattern``)
    patterns: dict[str, Tally] = dataclasses.field(default_factory=dict)
    expected_patterns: dict[str, Tally] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        key = (self.kind, self.axes)
        want = {key: Tally(self.expected_count, self.expected_bytes_sent)}
        got = {key: Tally(self.count, self.bytes_sent)}
        if cost.compare(want, got, RTOL, exact=self.exact):
            return False
        if not (self.patterns and self.expected_patterns):
            return True
        return not cost.compare_patterns(
            {key: self.expected_patterns}, {key: self.patterns}, (), RTOL
        )

    @property
    def pattern(self) -> str:
        """The measured patterns other than plain axis groups: ``shift +1 ×20, shift -1 ×20``."""
        return shown_patterns(self.patterns)

    def to_json(self) -> dict[str, Any]:
        fields = ("kind", "count", "bytes_sent", "expected_count", "expected_bytes_sent")

        def tallies(by: dict[str, Tally]) -> dict[str, Any]:
            return {p: {"count": t.count, "bytes_sent": t.bytes_sent} for p, t in by.items()}

        return {
            "axes": list(self.axes),
            **{f: getattr(self, f) for f in fields},
            "patterns": tallies(self.patterns),
            "expected_patterns": tallies(self.expected_patterns),
            "ok": self.ok,
        }


@dataclasses.dataclass(frozen=True)
class Report:
    """The measured ledger of one compiled train step beside its expectation.

    Attributes:
      ledger: what the compiled program does (``shardkit.ledger``).
      expectation: what it must do (``shardkit.cost``).
    """

    ledger: Ledger
    expectation: cost.Expectation
    # A pipeline's other stages, (stage, their report); this one is the last stage's.
    others: tuple[tuple[int, Report], ...] = ()

    @property
    def rows(self) -> tuple[Row, ...]:
        """One row per (kind, axes) measured or expected, in ``ledger.KINDS`` order."""
        got, want = self.ledger.summary(), self.expectation.summary()
        got_p, want_p = self.ledger.patterns(), self.expectation.patterns()
        zero = Tally(0, 0.0)
        keys = sorted(set(got) | set(want), key=_row_order)
        exact = self.expectation.exact
        return tuple(
            Row(k[0], k[1], *_pair(got.get(k, zero)), *_pair(want.get(k, zero)), exact,
                got_p.get(k, {}), want_p.get(k, {}))
            for k in keys
        )  # fmt: skip

    @property
    def measured_bytes_sent(self) -> float:
        """Bytes per step sent by this device (a pipeline: by the busiest stage's)."""
        others = [r.measured_bytes_sent for _, r in self.others]
        return max([self.ledger.total_bytes_sent(), *others])

    @property
    def expected_bytes_sent(self) -> float:
        others = [r.expected_bytes_sent for _, r in self.others]
        return max([self.expectation.total_bytes_sent(), *others])

    @property
    def ratio(self) -> float:
        """Measured / expected bytes (1.0 = the minimum, exactly; 1.0 when both are 0)."""
        if self.expected_bytes_sent == 0:
            return 1.0 if self.measured_bytes_sent == 0 else math.inf
        return self.measured_bytes_sent / self.expected_bytes_sent

    @property
    def mismatches(self) -> list[str]:
        """One sentence per (kind, axes) that breaks the contract; [] when it holds."""
        e, led = self.expectation, self.ledger
        own = cost.compare(e.summary(), led.summary(), RTOL, exact=e.exact)
        own += cost.compare_patterns(e.patterns(), led.patterns(), led.collectives, RTOL)
        if not self.others:
            return own
        last = self.expectation.plan.size("stage") - 1
        out = [f"stage {last}: {m}" for m in own]
        for stage, report in self.others:
            out += [f"stage {stage}: {m}" for m in report.mismatches]
        return out

    @property
    def contract_ok(self) -> bool:
        """Counts equal and bytes within 1%, per (kind, axes) (so in total too).

        Where the expectation is an upper bound (remat on one layer, ``Expectation.exact``):
        no more ops and bytes than expected.
        """
        return not self.mismatches

    def to_json(self) -> dict[str, Any]:
        """The ``shardkit inspect --json`` object (DESIGN.md keys, plus expectation fields)."""
        plan, mem = self.expectation.plan, self.ledger.memory
        return {
            "mesh": format_mesh(plan.mesh),
            "sp": plan.sp,
            "fsdp": plan.fsdp,
            "zero": plan.zero,
            "remat": plan.remat,
            "pp": plan.pp,
            "microbatches": plan.microbatches,
            "virtual": plan.virtual,
            "batch": self.expectation.batch,
            "collectives": [r.to_json() for r in self.rows],
            "measured_bytes_sent": self.measured_bytes_sent,
            "expected_bytes_sent": self.expected_bytes_sent,
            "ratio": self.ratio,
            "contract_ok": self.contract_ok,
            "contract_exact": self.expectation.exact,
            "mismatches": self.mismatches,
            "memory": {
                "argument": mem.argument if mem else None,
                "output": mem.output if mem else None,
                "temp": mem.temp if mem else None,
            },
        }

    def format(self) -> str:
        """A table of measured vs expected per (kind, axes), totals, ratio, memory, verdict."""
        head = f"{'collective':<20}{'axes':<30}{'count':>7}{'expected':>9}{'bytes sent':>15}"
        head += f"{'expected':>15}  ok  pattern"
        lines = [_title(self.expectation), head, "-" * len(head)]
        for r in self.rows:
            axes = ",".join(r.axes) or "-"
            lines.append(
                f"{r.kind:<20}{axes:<30}{r.count:>7}{r.expected_count:>9}{r.bytes_sent:>15,.0f}"
                f"{r.expected_bytes_sent:>15,.0f}  {'✓' if r.ok else '✗'}"
                + (f"  {r.pattern}" if r.pattern else "")
            )
        lines += [
            "-" * len(head),
            f"{'total per device per step':<66}{self.measured_bytes_sent:>15,.0f}"
            f"{self.expected_bytes_sent:>15,.0f}",
            f"measured / expected bytes: {self.ratio:.4f}",
            _memory_line(self.ledger),
            "contract: "
            + ("✓ holds" if self.contract_ok else "✗ " + " ".join(self.mismatches))
            + ("" if self.expectation.exact else " (an upper bound: remat on one layer)"),
        ]
        return "\n".join(line for line in lines if line)


def _pair(t: Tally) -> tuple[int, float]:
    return t.count, t.bytes_sent


def _row_order(key: Key) -> tuple[int, tuple[str, ...]]:
    return KINDS.index(key[0]), key[1]


def _title(e: cost.Expectation) -> str:
    c, p = e.cfg, e.plan
    model = f"ViT dim={c.dim} depth={c.depth} heads={c.heads} mlp={c.mlp_dim} tokens={c.num_tokens}"
    plan = f"mesh {format_mesh(p.mesh)} sp={p.sp} zero={p.zero} remat={p.remat}"
    if p.pp != "none":
        plan += f" pp={p.pp} microbatches={p.microbatches} virtual={p.virtual} (the last stage)"
    return f"{model}, batch {e.batch}, {c.dtype}; {plan}"


def _memory_line(ledger: Ledger) -> str:
    m = ledger.memory
    if m is None:
        return ""
    mib = 2.0**20
    return (
        f"memory per device: argument {m.argument / mib:.2f} MiB, output {m.output / mib:.2f} "
        f"MiB, temp {m.temp / mib:.2f} MiB"
    )


# ----------------------------------------------------------------------------- measuring


def default_optimizer() -> optax.GradientTransformation:
    """AdamW (``vit_ref.make_optimizer``): elementwise, so the update moves no bytes."""
    return vit_ref.make_optimizer()


def step_args(
    model: ShardedViT, batch: int, optimizer: optax.GradientTransformation
) -> tuple[Any, ...]:
    """Abstract (params, opt_state, images, labels) for ``model.train_step(optimizer)``.

    Shapes from ``vit_ref.init``; shardings as ``model.shard`` / ``init_opt_state`` /
    ``shard_batch`` place them (params as ``model.specs``, optimizer moments as
    ``model.state_specs``: like their params, but split over data under ZeRO-1/2).
    """
    model.check_batch(batch)
    specs = (model.specs, model.state_specs)
    return _args(model.cfg, *specs, model.sharding, model.batch_spec, batch, optimizer)


def _args(
    cfg: vit_ref.ViTConfig,
    specs: Any,
    state_specs: Any,
    sharding: Callable[[P], NamedSharding],
    batch_spec: P,
    batch: int,
    optimizer: optax.GradientTransformation,
) -> tuple[Any, ...]:
    shapes = jax.eval_shape(lambda: vit_ref.init(jax.random.key(0), cfg))
    params = _abstract(shapes, jax.tree.map(sharding, specs))
    opt_state = _abstract(*opt_state_layout(optimizer, shapes, state_specs, sharding))
    data = sharding(batch_spec)
    images = jax.ShapeDtypeStruct((batch, cfg.image, cfg.image, cfg.channels), jnp.float32)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return params, opt_state, _abstract(images, data), _abstract(labels, data)


def _abstract(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )


def measure_step(
    model: ShardedViT,
    batch: int,
    optimizer: optax.GradientTransformation | None = None,
    clip_norm: float | None = None,
) -> Ledger:
    """The ledger of ``model.train_step(optimizer, clip_norm)`` compiled for a global ``batch``."""
    optimizer = optimizer or default_optimizer()
    args = step_args(model, batch, optimizer)
    return measure(model.train_step(optimizer, clip_norm), *args, mesh=model.mesh)


def model_report(
    model: ShardedViT,
    batch: int,
    optimizer: optax.GradientTransformation | None = None,
    clip_norm: float | None = None,
) -> Report:
    """The contract report of an existing ``ShardedViT`` (e.g. the one ``verify`` just ran, or
    the clipped step ``shardkit train`` runs)."""
    ledger = measure_step(model, batch, optimizer, clip_norm)
    return report_of(ledger, model.cfg, model.plan, batch, clip=clip_norm is not None)


def report_of(
    ledger: Ledger, cfg: vit_ref.ViTConfig, plan: Plan, batch: int, **kwargs: Any
) -> Report:
    """The report of a measured step; under a pipeline one per stage (the last one shown)."""
    if plan.pp == "none":
        return Report(ledger, cost.expected(cfg, plan, batch, **kwargs))
    sched = schedule(plan)
    reports = [
        Report(stage_ledger(ledger, sched, s), cost.expected(cfg, plan, batch, stage=s, **kwargs))
        for s in range(sched.stages)
    ]
    return dataclasses.replace(reports[-1], others=tuple(enumerate(reports[:-1])))


# A collective inside a branch: its op_name holds the engine's segment scope, then its branch's.
_BRANCH = re.compile(
    pipeline.SEGMENT_SCOPE.format(r"(\d+)")
    + "/(?:.*/)?"
    + pipeline.BRANCH_SCOPE.format(r"(\d+)")
    + "/"
)


def stage_ledger(ledger: Ledger, sched: Schedule, stage: int) -> Ledger:
    """``ledger`` as one stage's device runs it: a collective inside a schedule branch counts
    the ticks this stage spends in that branch, not every tick of its segment (the ledger
    counts every branch of a conditional as if it ran; ``pipeline.branch_runs``).

    Raises:
      ValueError: a branch collective's count is not a multiple of its segment's length (XLA
        restructured the tick loop, so the per-stage count cannot be read).
    """
    runs = pipeline.branch_runs(sched)
    out = []
    for c in ledger.collectives:
        match = _BRANCH.search(c.op_name)
        if match:
            k, b = int(match.group(1)), int(match.group(2))
            length = int(runs[(k, -1)][stage])
            if c.count % length:
                raise ValueError(
                    f"Collective {c.name} in pipeline segment {k} runs {c.count} times, not a "
                    f"multiple of the segment's {length} ticks."
                )
            ran = int(runs[(k, b)][stage]) if (k, b) in runs else 0
            c = dataclasses.replace(c, count=c.count // length * ran)
        if c.count:
            out.append(c)
    return dataclasses.replace(ledger, collectives=tuple(out))


def inspect(
    cfg: vit_ref.ViTConfig,
    plan: Plan,
    batch: int,
    *,
    hlo_path: str | pathlib.Path | None = None,
    platform: str = "cpu",
) -> Report:
    """Compiles ``ShardedViT(cfg, plan)``'s train step and holds it to ``shardkit.cost``.

    Args:
      cfg: the model.
      plan: the parallelism plan.
      batch: the GLOBAL batch size.
      hlo_path: if given, the compiled HLO text is written there.
      platform: passed to ``cost.expected`` (element sizes of activation collectives).

    Returns:
      A :class:`Report`. Raises ``PlanError`` (one sentence) before compiling if the plan
      cannot run the model; the default device set must hold ``plan.num_devices`` devices.
    """
    cost.expected(cfg, plan, batch, platform=platform)  # checks the plan first
    ledger = measure_step(ShardedViT(cfg, plan), batch)
    if hlo_path is not None:
        pathlib.Path(hlo_path).write_text(ledger.hlo)
    return report_of(ledger, cfg, plan, batch, platform=platform)


# ----------------------------------------------------------------------------- XLA auto


def auto_train_step(
    cfg: vit_ref.ViTConfig, plan: Plan, optimizer: optax.GradientTransformation
) -> tuple[Callable[..., Any], Any, Any]:
    """The reference train step partitioned by XLA: ``(jitted step, param shardings,
    optimizer-state shardings)``.

    ``vit_ref``'s unsharded loss and AdamW update under ``jax.jit``, params placed with the
    plan's ``NamedSharding``s (heads and MLP hidden over model; embed over data with FSDP),
    the batch over data, and for the token-splitting modes what a GSPMD user would write: a
    ``with_sharding_constraint`` of the tokens over the plan's token axes (``seq`` for ring,
    Ulysses and USP, ``(seq, model)`` for Megatron-SP) at the embedding and every block input. XLA's
    partitioner (Shardy) chooses every collective; without the constraint it would not split
    tokens at all.
    """
    mesh = make_mesh(plan.mesh)
    constrain = _token_constraint(plan, mesh)
    specs = param_specs(cfg, plan)
    param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    shapes = jax.eval_shape(lambda: vit_ref.init(jax.random.key(0), cfg))
    _, opt_shardings = opt_state_layout(
        optimizer, shapes, state_specs(cfg, plan), lambda s: NamedSharding(mesh, s)
    )

    def step(params: Any, opt_state: Any, images: jax.Array, labels: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(vit_ref.loss_fn)(params, images, labels, cfg, constrain)
        params, opt_state = apply_optimizer(optimizer, grads, opt_state, params)
        return params, opt_state, {"loss": loss}

    out = (param_shardings, opt_shardings, NamedSharding(mesh, P()))
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=out), param_shardings, opt_shardings


def _token_constraint(plan: Plan, mesh: Any) -> Callable[[jax.Array], jax.Array] | None:
    """tokens[B_data, T_axis, D] as a sharding constraint, for plans that split tokens."""
    axes = {"ring": ("seq",), "ulysses": ("seq",), "usp": ("seq",), "megatron": ("seq", "model")}
    token_axes = tuple(a for a in axes.get(plan.sp, ()) if plan.size(a) > 1)
    if not token_axes:
        return None
    batch_axis = "data" if plan.size("data") > 1 else None
    tokens = NamedSharding(mesh, P(batch_axis, token_axes, None))
    return lambda x: jax.lax.with_sharding_constraint(x, tokens)


def measure_auto(cfg: vit_ref.ViTConfig, plan: Plan, batch: int) -> Ledger:
    """The ledger of ``auto_train_step`` compiled for a global ``batch`` (never run)."""
    check_plan(cfg, plan, batch)
    optimizer = default_optimizer()
    step, _, _ = auto_train_step(cfg, plan, optimizer)
    mesh = make_mesh(plan.mesh)
    batch_spec = P("data") if plan.size("data") > 1 else P()
    specs = (param_specs(cfg, plan), state_specs(cfg, plan))
    args = _args(cfg, *specs, lambda s: NamedSharding(mesh, s), batch_spec, batch, optimizer)
    return measure(step, *args, mesh=mesh)
