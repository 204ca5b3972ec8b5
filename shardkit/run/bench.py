"""``shardkit bench``: shardkit's train step vs XLA's automatic partitioner vs one device.

For each strategy, on the same model, params, batch and CPU mesh, in ONE process, three
contenders take the same AdamW step:

  shardkit     ``ShardedViT.train_step`` (every collective hand-written in shard_map);
  auto         ``vit_ref``'s step under ``jax.jit`` with ``NamedSharding`` params and batch and
               no shard_map (``auto_train_step``): params laid out by the same rules
               table, and for the token-splitting modes a ``with_sharding_constraint`` of the
               tokens at the embedding and every block input — what a GSPMD user would write;
  one device   ``vit_ref.make_train_step`` on the first device.

Timing: each compiled step runs ``warmup`` rounds, then ``steps`` rounds in which the three run
one after another (interleaved, so machine noise hits all three alike); each call is timed to
completion (``block_until_ready``) and the row reports median, min and max. The bytes each
sharded step sends per device come from its compiled HLO (``comm.ledger``), memory from
``memory_analysis`` (per device), and model FLOPs are counted analytically (``model_flops``:
6 × matmul params × tokens plus attention; XLA's own count sees a scan body once). MFU is
achieved FLOP/s over the matmul peak measured in the same run (``matmul_peak``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vit_ref
from shardkit.comm.ledger import Ledger, ledger_of, measure
from shardkit.mesh import Plan, format_mesh, make_mesh
from shardkit.models.vit import (
    ShardedViT,
    check_plan,
    param_specs,
    stacked,
    state_specs,
    token_split,
)
from shardkit.models.vit.report import abstract_step_args, default_optimizer, report_of
from shardkit.parallel import data as dp
from shardkit.parallel.sequence import USP_SEQ
from shardkit.run.verify import Case, default_matrix, make_batch
from vit_ref.train import apply_optimizer

# A model whose matmuls dominate dispatch on this box, and a full default run in minutes.
DEFAULT_MODEL = dict(
    image=32, patch=4, channels=3, classes=10, dim=256, depth=4, heads=8, mlp_dim=1024, pool="tok"
)
DEFAULT_BATCH = 32


def strategies(devices: int = 8) -> list[Case]:
    """Every strategy the project has (``verify``'s matrix without remat: auto has none)."""
    return [case for case in default_matrix(devices) if not case.plan.recompute]


# ----------------------------------------------------------------------------- FLOPs


def model_flops(cfg: vit_ref.ViTConfig, batch: int) -> float:
    """FLOPs of one train step (forward + backward), counted on paper.

    Matmuls: 2 FLOPs per multiply-add forward and 4 backward (input and weight gradients), so
    6 × params × the rows they see: the patch embedding and every block weight see all b·t
    tokens, the head sees b pooled rows. Attention: q·kᵀ and p·v are 2·t²·d each per example
    and layer forward, twice that backward: 12·b·t²·d·l. LayerNorm, GELU, softmax and the
    optimizer are elementwise and left out, as MFU conventionally does.
    """
    shapes = jax.eval_shape(lambda: vit_ref.init(jax.random.key(0), cfg))
    t = cfg.num_tokens
    kernels = [p for p in jax.tree_util.tree_leaves_with_path(shapes) if "kernel" in str(p[0])]
    per_token = sum(math.prod(s.shape) for path, s in kernels if "head" not in str(path))
    head = math.prod(shapes["head"]["kernel"].shape)
    return 6.0 * (per_token * batch * t + head * batch) + 12.0 * batch * t * t * cfg.dim * cfg.depth


def matmul_peak(n: int = 2048, reps: int = 3) -> float:
    """FLOP/s of the best of ``reps`` float32 [n, n] @ [n, n] matmuls on the first device."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a)) for _ in range(reps))
    return 2.0 * n**3 / best


def _timed(call: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- contenders


@dataclasses.dataclass
class Contender:
    """One compiled train step and the state it carries from call to call."""

    step: Any  # a compiled, donating (params, opt_state, images, labels) -> (params, opt_state, _)
    params: Any
    opt_state: Any
    batch: tuple[jax.Array, ...]
    compile_s: float
    program: str  # the lowered StableHLO text: what was asked of XLA, before partitioning
    ledger: Ledger | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    metrics: Any = None  # the last step's

    def run(self) -> float:
        """One step, timed until every output is ready (the new params and state too: XLA:CPU
        can deadlock when a program starts on some devices while the last one still runs on
        others, its threads waiting in each other's rendezvous)."""
        t0 = time.perf_counter()
        self.params, self.opt_state, metrics = self.step(self.params, self.opt_state, *self.batch)
        jax.block_until_ready((self.params, self.opt_state, metrics))
        self.metrics = metrics
        return time.perf_counter() - t0


def compile_timed(fn: Any, *args: Any) -> tuple[Any, float, str]:
    """(compiled, compile seconds, lowered text)."""
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    compiled = lowered.compile()
    return compiled, time.perf_counter() - t0, lowered.as_text()


def shardkit_contender(cfg: vit_ref.ViTConfig, plan: Plan, params: Any, batch: Any) -> Contender:
    model = ShardedViT(cfg, plan)
    optimizer = default_optimizer()
    placed = model.shard(params)
    state = model.init_opt_state(optimizer, placed)
    data = model.shard_batch(*batch)
    step, seconds, program = compile_timed(model.train_step(optimizer), placed, state, *data)
    return Contender(step, placed, state, data, seconds, program, ledger_of(step, model.mesh))


def auto_contender(cfg: vit_ref.ViTConfig, plan: Plan, params: Any, batch: Any) -> Contender:
    optimizer = default_optimizer()
    step_fn, shardings, opt_shardings = auto_train_step(cfg, plan, optimizer)
    mesh = jax.tree.leaves(shardings)[0].mesh
    placed = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings)(params)
    state = jax.jit(optimizer.init, out_shardings=opt_shardings)(placed)
    data_sharding = NamedSharding(mesh, P("data") if plan.size("data") > 1 else P())
    data = tuple(jax.device_put(a, data_sharding) for a in batch)
    step, seconds, program = compile_timed(step_fn, placed, state, *data)
    return Contender(step, placed, state, data, seconds, program, ledger_of(step, mesh))


def single_device_contender(cfg: vit_ref.ViTConfig, params: Any, batch: Any) -> Contender:
    optimizer = default_optimizer()
    device = jax.devices()[0]
    placed = jax.device_put(jax.tree.map(jnp.copy, params), device)
    state = jax.jit(optimizer.init)(placed)
    data = tuple(jax.device_put(a, device) for a in batch)
    step, seconds, program = compile_timed(
        vit_ref.make_train_step(cfg, optimizer, remat="none"), placed, state, *data
    )
    return Contender(step, placed, state, data, seconds, program)


# ----------------------------------------------------------------------------- rows


@dataclasses.dataclass
class Row:
    """One strategy's results; ``auto_error`` is XLA's one-line reason if auto failed."""

    strategy: str
    mesh: str
    values: dict[str, Any]
    auto_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "mesh": self.mesh, **self.values,
                "auto_error": self.auto_error}  # fmt: skip


def time_stats(prefix: str, times: Sequence[float]) -> dict[str, float]:
    return {
        f"{prefix}_step_s": statistics.median(times),
        f"{prefix}_step_min_s": min(times),
        f"{prefix}_step_max_s": max(times),
    }


def memory_stats(prefix: str, ledger: Ledger | None) -> dict[str, int | None]:
    mem = ledger.memory if ledger is not None else None
    return {
        f"{prefix}_argument_bytes": mem.argument if mem else None,
        f"{prefix}_temp_bytes": mem.temp if mem else None,
    }


def _row(
    case: Case, cfg: vit_ref.ViTConfig, batch: int, ours: Contender, auto: Contender | None,
    single: Contender, peak: float,
) -> dict[str, Any]:  # fmt: skip
    flops = model_flops(cfg, batch)
    assert ours.ledger is not None
    # Per stage under a pipeline: the raw ledger counts every stage's schedule branches.
    contract = report_of(ours.ledger, cfg, case.plan, batch)
    v: dict[str, Any] = {
        **time_stats("shardkit", ours.times),
        **time_stats("single_device", single.times),
        "shardkit_bytes_sent": contract.measured_bytes_sent,
        "expected_bytes_sent": contract.expected_bytes_sent,
        **memory_stats("shardkit", ours.ledger),
        "shardkit_compile_s": ours.compile_s,
        "model_flops": flops,
        "peak_flops_per_s": peak,
    }
    v["ratio_vs_single_device"] = v["shardkit_step_s"] / v["single_device_step_s"]
    v["shardkit_flops_per_s"] = flops / v["shardkit_step_s"]
    v["shardkit_mfu"] = v["shardkit_flops_per_s"] / peak
    v["single_device_mfu"] = flops / v["single_device_step_s"] / peak
    if auto is not None and auto.ledger is not None:
        v |= time_stats("auto", auto.times) | memory_stats("auto", auto.ledger)
        v["auto_bytes_sent"] = auto.ledger.total_bytes_sent()
        v["auto_compile_s"] = auto.compile_s
        v["ratio_vs_auto"] = v["shardkit_step_s"] / v["auto_step_s"]
        v["auto_mfu"] = flops / v["auto_step_s"] / peak
    else:
        v |= dict.fromkeys(("auto_step_s", "auto_bytes_sent", "ratio_vs_auto", "auto_mfu"))
    return v


def bench_case(
    case: Case, cfg: vit_ref.ViTConfig, batch: int, steps: int, warmup: int,
    single: Contender, peak: float, params: Any, data: Any,
) -> Row:  # fmt: skip
    """Compiles shardkit's and auto's steps for ``case`` and times them against ``single``."""
    ours = shardkit_contender(cfg, case.plan, params, data)
    auto: Contender | None
    error = None
    try:
        auto = auto_contender(cfg, case.plan, params, data)
    except Exception as err:  # XLA's one-line reason goes into the row; the run goes on
        auto, error = None, (str(err).strip().splitlines() or [type(err).__name__])[0]
    single.times = []
    contenders = [c for c in (ours, auto, single) if c is not None]
    for round_ in range(warmup + steps):
        for c in contenders:
            seconds = c.run()
            if round_ >= warmup:
                c.times.append(seconds)
    values = _row(case, cfg, batch, ours, auto, single, peak)
    return Row(case.name, format_mesh(case.plan.mesh), values, error)


def run(
    cfg: vit_ref.ViTConfig,
    cases: Sequence[Case],
    batch: int,
    steps: int = 5,
    warmup: int = 2,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Benchmarks every case; returns ``{"rows": [...], ...}`` (``shardkit bench --json``)."""
    for case in cases:  # every plan is checked before anything compiles
        check_plan(cfg, case.plan, batch)
    peak = matmul_peak()
    params = vit_ref.init(jax.random.key(0), dataclasses.replace(cfg, head_zeroinit=False))
    data = tuple(np.asarray(a) for a in make_batch(cfg, batch))
    single = single_device_contender(cfg, params, data)
    rows = []
    for case in cases:
        progress(f"{case.name} ({format_mesh(case.plan.mesh)}, sp={case.plan.sp})")
        rows.append(bench_case(case, cfg, batch, steps, warmup, single, peak, params, data))
    return {
        "model": dataclasses.asdict(cfg),
        "batch": batch,
        "devices": jax.device_count(),
        "steps": steps,
        "warmup": warmup,
        "peak_flops_per_s": peak,
        "single_device_compile_s": single.compile_s,
        "rows": [row.to_json() for row in rows],
    }


# ----------------------------------------------------------------------------- output

COLUMNS = [  # header, key, format
    ("strategy", "strategy", "{}"),
    ("mesh", "mesh", "{}"),
    ("shardkit ms", "shardkit_step_s", "ms"),
    ("auto ms", "auto_step_s", "ms"),
    ("1-dev ms", "single_device_step_s", "ms"),
    ("/auto", "ratio_vs_auto", "{:.2f}"),
    ("/1-dev", "ratio_vs_single_device", "{:.2f}"),
    ("shardkit MB", "shardkit_bytes_sent", "MB"),
    ("auto MB", "auto_bytes_sent", "MB"),
    ("min MB", "expected_bytes_sent", "MB"),
    ("temp MiB", "shardkit_temp_bytes", "MiB"),
    ("auto temp MiB", "auto_temp_bytes", "MiB"),
    ("MFU", "shardkit_mfu", "{:.1%}"),
    ("auto MFU", "auto_mfu", "{:.1%}"),
]


def cell(value: Any, fmt: str) -> str:
    """A table cell: ``fmt`` a format string, or a unit (ms, MB, MiB, GFLOP) to scale to."""
    if value is None:  # a contender that failed (named below the table), or nothing to state
        return "-"
    scale = {"ms": (1e3, "{:.1f}"), "MB": (1e-6, "{:.2f}"), "MiB": (2**-20, "{:.1f}"),
             "GFLOP": (1e-9, "{:.3f}")}  # fmt: skip
    if fmt in scale:
        factor, fmt = scale[fmt]
        return fmt.format(value * factor)
    return fmt.format(value)


def _aligned(cells: Sequence[str], widths: Sequence[int]) -> str:
    """Names left-aligned (the first two columns), numbers right-aligned."""
    return "  ".join(
        c.ljust(w) if i < 2 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )


def table_lines(header: Sequence[str], body: Sequence[Sequence[str]], markdown: bool) -> list[str]:
    """A table's lines: Markdown, or plain text with names (the first two columns) left-aligned
    and numbers right-aligned."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return lines + ["| " + " | ".join(cells) + " |" for cells in body]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return [_aligned(cells, widths) for cells in [header, *body]]


def format_table(
    result: dict[str, Any],
    markdown: bool = False,
    columns: Sequence[tuple[str, str, str]] = COLUMNS,
) -> str:
    """The rows as a plain-text (or Markdown) table, then the peak and the failures."""
    header = [name for name, _, _ in columns]
    body = [[cell(row.get(key), fmt) for _, key, fmt in columns] for row in result["rows"]]
    lines = table_lines(header, body, markdown)
    peak = result["peak_flops_per_s"] / 1e9
    lines.append(
        f"\nmedian of {result['steps']} interleaved steps after {result['warmup']} warm-up; "
        f"batch {result['batch']}; {result['devices']} CPU devices; matmul peak {peak:.0f} GFLOP/s"
    )
    lines += [f"auto failed on {r['strategy']}: {r['auto_error']}" for r in result["rows"]
              if r["auto_error"]]  # fmt: skip
    return "\n".join(lines)


def _short_mesh(mesh: str) -> str:
    """ "data=4,seq=1,model=2" -> "data=4,model=2" (axes of size 1 left out)."""
    return ",".join(p for p in mesh.split(",") if not p.endswith("=1")) or "1 device"


def plot(result: dict[str, Any], path: str) -> None:
    """Bars per strategy: step time (three contenders) and bytes sent (two, and the minimum)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = np.arange(len(rows))
    fig, (ax_t, ax_b) = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(rows)), 7), sharex=True)
    for i, (key, label) in enumerate(
        [("shardkit_step_s", "shardkit"), ("auto_step_s", "XLA auto"),
         ("single_device_step_s", "one device")]
    ):  # fmt: skip
        ax_t.bar(x + (i - 1) * 0.27, [1e3 * (r[key] or 0) for r in rows], 0.27, label=label)
    ax_t.set(ylabel="step time, median (ms)", title="train step: shardkit vs XLA auto vs 1 device")
    ax_t.legend()
    for i, (key, label) in enumerate(
        [("shardkit_bytes_sent", "shardkit"), ("auto_bytes_sent", "XLA auto"),
         ("expected_bytes_sent", "analytic minimum")]
    ):  # fmt: skip
        ax_b.bar(x + (i - 1) * 0.27, [1e-6 * (r[key] or 0) for r in rows], 0.27, label=label)
    ax_b.set(ylabel="MB sent per device per step")
    ax_b.legend()
    ax_b.set_xticks(
        x,
        [f"{r['strategy']}\n{_short_mesh(r['mesh'])}" for r in rows],
        fontsize=8,
        rotation=30,
        ha="right",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- XLA auto


def auto_train_step(
    cfg: vit_ref.ViTConfig,
    plan: Plan,
    optimizer: optax.GradientTransformation,
    devices: Any = None,
) -> tuple[Callable[..., Any], Any, Any]:
    """The reference train step partitioned by XLA: ``(jitted step, param shardings,
    optimizer-state shardings)``.

    ``vit_ref``'s unsharded loss and AdamW update under ``jax.jit``, params placed with the
    plan's ``NamedSharding``s (heads and MLP hidden over model; embed over data with FSDP),
    the batch over data, and for the token-splitting modes what a GSPMD user would write: a
    ``with_sharding_constraint`` of the tokens over the plan's token axes (``seq`` for ring,
    Ulysses and USP, ``(seq, model)`` for Megatron-SP) at the embedding and every block input. XLA's
    partitioner (Shardy) chooses every collective; without the constraint it would not split
    tokens at all. ``devices``: the mesh's (default ``jax.devices()``; a TPU slice's under
    ``bench --target``).
    """
    mesh = make_mesh(plan.mesh, devices)
    constrain = _token_constraint(cfg, plan, mesh)
    plan = stacked(plan)  # vit_ref's params as init gives them
    specs = param_specs(cfg, plan)
    param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    shapes = jax.eval_shape(lambda: vit_ref.init(jax.random.key(0), cfg))
    _, opt_shardings = dp.opt_state_layout(
        optimizer, shapes, state_specs(cfg, plan), lambda s: NamedSharding(mesh, s)
    )

    def step(params: Any, opt_state: Any, images: jax.Array, labels: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(vit_ref.loss_fn)(params, images, labels, cfg, constrain)
        params, opt_state = apply_optimizer(optimizer, grads, opt_state, params)
        return params, opt_state, {"loss": loss}

    out = (param_shardings, opt_shardings, NamedSharding(mesh, P()))
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=out), param_shardings, opt_shardings


def _token_constraint(
    cfg: vit_ref.ViTConfig, plan: Plan, mesh: Any
) -> Callable[[jax.Array], jax.Array] | None:
    """tokens[B_data, T_axes, D] as a sharding constraint, for plans that split tokens (the
    plan's own token split, USP's two seq axes named as the one ``seq`` of this mesh)."""
    split = token_split(cfg, plan).token_axes
    named = dict.fromkeys("seq" if a in USP_SEQ else a for a in split)
    token_axes = tuple(a for a in named if plan.size(a) > 1)
    if not token_axes:
        return None
    batch_axis = "data" if plan.size("data") > 1 else None
    tokens = NamedSharding(mesh, P(batch_axis, token_axes, None))
    return lambda x: jax.lax.with_sharding_constraint(x, tokens)


def measure_auto(
    cfg: vit_ref.ViTConfig,
    plan: Plan,
    batch: int,
    devices: Any = None,
    compiler_options: dict[str, str] | None = None,
) -> Ledger:
    """The ledger of ``auto_train_step`` compiled for a global ``batch`` (never run), over
    ``devices`` (default ``jax.devices()``) with ``compiler_options``."""
    check_plan(cfg, plan, batch)
    optimizer = default_optimizer()
    step, _, _ = auto_train_step(cfg, plan, optimizer, devices)
    mesh = make_mesh(plan.mesh, devices)
    batch_spec = P("data") if plan.size("data") > 1 else P()
    specs = (param_specs(cfg, stacked(plan)), state_specs(cfg, stacked(plan)))
    sharding = lambda s: NamedSharding(mesh, s)  # noqa: E731
    args = abstract_step_args(cfg, *specs, sharding, batch_spec, batch, optimizer)
    return measure(step, *args, mesh=mesh, compiler_options=compiler_options)
