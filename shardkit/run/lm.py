"""The decoder's commands: ``shardkit verify | inspect | train --model gpt`` (or ``moe-gpt``).

The model is ``models.gpt``'s Llama-style decoder on the Zen of Python, dense or with MoE
blocks (``--experts E --top-k K --capacity-factor C``, experts over the ``expert`` mesh axis).
A plan is a mesh, a sequence core (``--sp ring``: the causal ring in the zigzag layout;
``--sp ulysses``: Ulysses in the striped layout) and ``--fsdp``.

  verify   sharded == the twin (loss with the MoE losses, every gradient leaf, one AdamW step)
           on one plan, or on the default plans (``PLANS``; ``MOE_PLANS`` with experts)
  inspect  the clipped train step's collectives against ``models.gpt.cost`` (ring or no seq
           core), memory, the contract's verdict
  train    AdamW with warmup and cosine decay; per logged step the loss (and the dropped
           fraction), ``DIR/metrics.jsonl`` (with tokens per expert), ``config.json``,
           ``curves.png``
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from shardkit import testing
from shardkit.comm import ledger
from shardkit.comm.report import Report
from shardkit.mesh import PlanError, format_mesh, make_mesh, parse_mesh
from shardkit.models import gpt, staged
from shardkit.models.sharded import ShardedModel
from shardkit.parallel import moe
from shardkit.parallel.sequence import layouts

LM_MODELS = ("gpt", "moe-gpt")
SP_CORES = {"none": ("ring", "contiguous"), "ring": ("ring", "zigzag"),
            "ulysses": ("ulysses", "striped")}  # fmt: skip
# --8<-- [start:plans]
PLANS = {  # name: (mesh, sp, fsdp); sp ring: the zigzag ring; ulysses: the striped layout
    "data×model": ("data=2,model=4", "none", False),
    "ring, zigzag": ("data=2,seq=4", "ring", False),
    "Ulysses, KV repeat": ("seq=2,model=4", "ulysses", False),
    "FSDP": ("data=4,model=2", "none", True),
    "3-D: data×seq×model": ("data=2,seq=2,model=2", "ring", False),
}
MOE_PLANS = {
    "EP=8": ("expert=8", "none", False),
    "EP×DP": ("data=2,expert=4", "none", False),
    "EP×TP×DP": ("data=2,expert=2,model=2", "none", False),
    "EP×FSDP": ("data=2,expert=4", "none", True),
    "EP×ring, zigzag": ("expert=2,seq=4", "ring", False),
}
# --8<-- [end:plans]
TOLERANCE = 1e-5


def config(
    model: str,
    experts: int | None,
    top_k: int,
    capacity_factor: str,
    documents: bool = False,
    tied: bool = False,
) -> gpt.GPTConfig:
    """The decoder of ``--model``; ``moe-gpt``: ``experts`` (default 8) top-``top_k`` experts,
    ``capacity_factor`` a number or "none" (dropless); ``documents``: packed documents;
    ``tied``: the head is the embedding's transpose."""
    if model == "gpt":  # (the CLI refuses the MoE flags for it)
        return gpt.GPTConfig(documents=documents, tied=tied)
    try:
        factor = None if capacity_factor == "none" else float(capacity_factor)
    except ValueError:
        raise PlanError(
            f"--capacity-factor must be a number or none, got {capacity_factor!r}."
        ) from None
    try:
        return gpt.moe_config(moe.MoE(experts or 8, top_k, factor), documents=documents,
                              tied=tied)  # fmt: skip
    except ValueError as err:
        raise PlanError(str(err)) from None


def plan(
    mesh: str,
    sp: str | None,
    fsdp: bool,
    remat: str = "none",
    kernel: str = "auto",
    pp: tuple[str, int, int] = ("none", 1, 1),
) -> gpt.GPTPlan:
    """A plan from ``--mesh``, ``--sp`` (none, ring, ulysses), ``--fsdp``, ``--remat``,
    ``--kernel`` and ``pp``: (``--pp``, ``--microbatches``, ``--virtual``)."""
    shape = parse_mesh(mesh)
    sp = sp or ("ring" if shape["seq"] > 1 else "none")
    if sp not in SP_CORES:
        raise PlanError(f"--sp {sp} does not apply to the GPT; choose none, ring or ulysses.")
    if sp == "none" and shape["seq"] > 1:
        raise PlanError(f"The mesh has seq={shape['seq']}; give --sp ring or ulysses.")
    core, layout = SP_CORES[sp]
    layout = layout if shape["seq"] > 1 else "contiguous"
    return gpt.GPTPlan(shape, layout, core, fsdp, remat, kernel, *pp)


def default_plans(cfg: gpt.GPTConfig, kernel: str = "auto") -> dict[str, gpt.GPTPlan]:
    """``verify``'s plans for the dense or the MoE decoder, attention on ``kernel``."""
    table = PLANS if cfg.experts is None else MOE_PLANS
    return {name: plan(*row, kernel=kernel) for name, row in table.items()}


def build(cfg: gpt.GPTConfig, p: gpt.GPTPlan, batch: int) -> ShardedModel:
    """The sharded decoder of ``p`` (checked first: one sentence on failure)."""
    gpt.check_plan(cfg, p, batch)
    return gpt.sharded_gpt(make_mesh(p.mesh), cfg, p)


def sample(cfg: gpt.GPTConfig, batch: int, seed: int = 0) -> tuple[jax.Array, ...]:
    """x, y[batch, T] (and, packed documents, segment ids and positions): windows of the text
    in natural order (seeded)."""
    return gpt.windows(np.random.default_rng(seed), batch, cfg.tokens, cfg.documents)


def ordered(p: gpt.GPTPlan, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """[B, T] arrays in the plan's layout order over seq (what its batch spec expects)."""
    return tuple(layouts.to_layout(a, p.mesh["seq"], p.layout) for a in arrays)


def _loss(out: Any) -> Any:
    return out["loss"] if isinstance(out, dict) else out


# ----------------------------------------------------------------------------- verify


def verify_case(cfg: gpt.GPTConfig, name: str, p: gpt.GPTPlan, batch: int) -> dict[str, Any]:
    """One plan against the twin: the ``verify --json`` case object."""
    model = build(cfg, p, batch)
    params, data = gpt.init(0, cfg), sample(cfg, batch)

    def sharded(params: Any, *data: jax.Array) -> tuple[Any, Any]:
        out, grads = model.loss_and_grads(params, *ordered(p, *data))
        return _loss(out), model.to_reference(grads)  # a pipeline's layers in stage order

    def twin(params: Any, x: jax.Array, y: jax.Array, *docs: jax.Array) -> jax.Array:
        return gpt.twin_loss(params, x, y, cfg, p, seg=docs[0] if docs else None)

    check = testing.compare_sharded(sharded, twin, params, *data, place=model.shard)
    errors = {"loss": check.loss, "grads": max(check.grads.values()),
              "step": max(check.step.values())}  # fmt: skip
    sp = f"{p.core} {p.layout}" if p.mesh["seq"] > 1 else "none"
    pp = "none" if p.pp == "none" else f"{p.pp} M={p.microbatches}"
    pp += f" V={p.virtual}" if p.virtual > 1 else ""
    return {"name": name, "mesh": format_mesh(p.mesh), "sp": sp, "pp": pp,
            "fsdp": p.fsdp, "ok": check.ok, "errors": errors, "worst": check.worst[0],
            "tolerance": TOLERANCE}  # fmt: skip


def verify(
    cfg: gpt.GPTConfig,
    plans: dict[str, gpt.GPTPlan],
    batch: int,
    *,
    as_json: bool = False,
    echo: Callable[..., Any] = print,
) -> bool:
    """Every plan in turn (all checked first); a row each, or one JSON object."""
    for p in plans.values():
        gpt.check_plan(cfg, p, batch)
    row = "{:<22}{:<39}{:<18}{:>6}{:>10}{:>10}{:>10}  {}"
    if not as_json:
        echo(row.format("case", "mesh", "sp", "fsdp", "loss", "grads", "step", "ok"), flush=True)
    cases = []
    for name, p in plans.items():
        c = verify_case(cfg, name, p, batch)
        cases.append(c)
        if not as_json:
            e = c["errors"]
            sp = c["sp"] if c["pp"] == "none" else f"{c['sp']}, {c['pp']}"
            echo(row.format(name, c["mesh"], sp, "✓" if p.fsdp else "-", f"{e['loss']:.1e}",
                            f"{e['grads']:.1e}", f"{e['step']:.1e}",
                            "✓" if c["ok"] else f"✗ {c['worst']}"), flush=True)  # fmt: skip
    ok = all(c["ok"] for c in cases)
    if as_json:
        echo(json.dumps({"ok": ok, "model": model_name(cfg), "cases": cases}))
    else:
        echo(f"{sum(c['ok'] for c in cases)}/{len(cases)} plans match the twin "
             f"({model_name(cfg)}, batch {batch}, tolerance {TOLERANCE:g}).")  # fmt: skip
    return ok


def model_name(cfg: gpt.GPTConfig) -> str:
    """The ``--model`` name of ``cfg``."""
    return "gpt" if cfg.experts is None else "moe-gpt"


def describe(cfg: gpt.GPTConfig) -> dict[str, Any]:
    """``{"model", "dims", "experts"}``: the config as a run's JSON states it."""
    experts = None if cfg.experts is None else vars(cfg.experts)
    dims = {k: v for k, v in vars(cfg).items() if k != "experts"}
    return {"model": model_name(cfg), "dims": dims, "experts": experts}


# ----------------------------------------------------------------------------- inspect


def inspect(cfg: gpt.GPTConfig, p: gpt.GPTPlan, batch: int, *, as_json: bool = False) -> str:
    """The clipped train step's ledger against the cost model (a table or one JSON object);
    with experts, the routing of the inspected batch (one step run: tokens per expert,
    dropped assignments)."""
    model = build(cfg, p, batch)
    optimizer = optax.adamw(1e-3)
    step = model.train_step(optimizer, clip_norm=1.0)
    params = model.shard(gpt.init(0, cfg))
    state = model.init_opt_state(optimizer, params)
    inputs = model.shard_batch(*ordered(p, *sample(cfg, batch)))
    measured = ledger.measure(step, params, state, *inputs, mesh=model.mesh)
    local = sum(leaf.addressable_shards[0].data.size for leaf in jax.tree.leaves(params))
    routing = _routing(model, params, inputs) if cfg.experts is not None else {}
    expectation = gpt.expectation(cfg, p, batch, local)
    if expectation is None:
        note = f"no cost model for {gpt.no_terms_reason(cfg, p)}: measured only"
        if as_json:
            return json.dumps({"model": model_name(cfg), **measured.to_json(), "note": note,
                               **routing})  # fmt: skip
        return ledger.format_table(measured) + f"\n({note})" + _routing_line(routing)
    report = _per_stage(cfg, p, batch, local, measured) if p.pp != "none" else None
    report = report or Report(measured, expectation)
    if as_json:
        return json.dumps({**report.to_json(), **routing})
    return report.format() + _routing_line(routing)


def _per_stage(
    cfg: gpt.GPTConfig, p: gpt.GPTPlan, batch: int, local: int, measured: ledger.Ledger
) -> Report:
    """A pipeline's report: each stage's ledger against its own expectation."""

    def expectation(stage: int) -> gpt.GPTExpectation:
        terms = gpt.expectation(cfg, p, batch, local, stage)
        assert terms is not None  # None only for Ulysses or remat: measured only, above
        return terms

    return staged.stage_report(measured, p.schedule(), expectation)


def _routing(model: ShardedModel, params: Any, inputs: tuple[jax.Array, ...]) -> dict[str, Any]:
    """The MoE metrics of one forward and backward on ``inputs`` (the step's own)."""
    out, _ = model.loss_and_grads(params, *inputs)
    return {k: v for k, v in _host(dict(out)).items() if k != "loss"}  # aux: a dict


def _routing_line(routing: dict[str, Any]) -> str:
    if not routing:
        return ""
    return (f"\nrouting of this batch: tokens per expert {routing['tokens_per_expert']}, "
            f"dropped {int(routing['dropped'])} ({routing['dropped_fraction']:.1%})")  # fmt: skip


# ----------------------------------------------------------------------------- train


def train(
    cfg: gpt.GPTConfig,
    p: gpt.GPTPlan,
    *,
    steps: int,
    batch: int,
    lr: float = 1e-2,
    seed: int = 0,
    out: pathlib.Path | None = None,
    warmup: int | None = None,
    clip: float = 1.0,
    weight_decay: float = 1e-4,
    echo: Callable[..., Any] = print,
) -> list[dict[str, Any]]:
    """AdamW (linear warmup, 10% of the steps unless given; cosine decay; the gradients
    clipped to ``clip``) on windows of the text; the records, one per step."""
    model = build(cfg, p, batch)
    warmup = max(1, steps // 10) if warmup is None else warmup
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1))
    optimizer = optax.adamw(schedule, weight_decay=weight_decay)
    step = model.train_step(optimizer, clip_norm=clip)
    params = model.shard(gpt.init(seed, cfg))
    state = model.init_opt_state(optimizer, params)
    rng, records = np.random.default_rng(seed), []
    for i in range(steps):
        inputs = model.shard_batch(*ordered(p, *sample(cfg, batch, int(rng.integers(2**31)))))
        params, state, metrics = step(params, state, *inputs)
        jax.block_until_ready((params, state))  # XLA:CPU: no step starts while one still runs
        record = {"step": i + 1, **_host(metrics)}
        records.append(record)
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(f"step {i + 1}: the loss is {record['loss']}; stopping.")
        if i == 0 or (i + 1) % max(1, steps // 10) == 0 or i + 1 == steps:
            echo(_line(record), flush=True)
    if out is not None:
        _write_run(out, cfg, p, batch, steps, records)
    return records


def train_command(
    cfg: gpt.GPTConfig, p: gpt.GPTPlan, batch: int, *, out: str | None, force: bool, **opts: Any
) -> int:
    """``shardkit train --model gpt | moe-gpt``: the run, its files in ``out`` (if given), the
    closing line; 1 if the loss stopped being finite."""
    from shardkit.run.train import prepare_out_dir

    directory = pathlib.Path(out) if out else None
    if directory is not None:
        prepare_out_dir(directory, force)
    try:
        records = train(cfg, p, batch=batch, out=directory, **opts)
    except FloatingPointError as err:
        print(f"shardkit: {err}", file=sys.stderr)
        return 1
    wrote = f"; wrote {out}/{{metrics.jsonl,config.json,curves.png}}" if out else ""
    print(f"step {records[-1]['step']}: loss {records[-1]['loss']:.4f}{wrote}")
    return 0


def _host(metrics: dict[str, Any]) -> dict[str, Any]:
    got = jax.device_get(metrics)
    return {k: (float(v) if np.ndim(v) == 0 else np.asarray(v).astype(int).tolist())
            for k, v in got.items()}  # fmt: skip


def _line(r: dict[str, Any]) -> str:
    line = f"step {r['step']:5d}  loss {r['loss']:.4f}  grad norm {r['grad_norm']:.3f}"
    if "dropped_fraction" in r:
        line += f"  dropped {r['dropped_fraction']:6.1%}"
    return line


def _write_run(
    out: pathlib.Path,
    cfg: gpt.GPTConfig,
    p: gpt.GPTPlan,
    batch: int,
    steps: int,
    records: list[dict[str, Any]],
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    config = {**describe(cfg), "plan": vars(p), "batch": batch, "steps": steps}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    plot(records, out / "curves.png")


def plot(records: list[dict[str, Any]], path: pathlib.Path) -> None:
    """The loss (and, with experts, the dropped fraction) against step, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe_run = "dropped_fraction" in records[0]
    fig, axes = plt.subplots(1, 2 if moe_run else 1, figsize=(10 if moe_run else 5, 3.6))
    ax_loss = axes[0] if moe_run else axes
    steps = [r["step"] for r in records]
    ax_loss.plot(steps, [r["loss"] for r in records], lw=1)
    ax_loss.set(xlabel="step", ylabel="loss", yscale="log", title="training loss")
    if moe_run:
        axes[1].plot(steps, [100 * r["dropped_fraction"] for r in records], lw=1, color="C3")
        axes[1].set(xlabel="step", ylabel="%", title="assignments dropped (no slot)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
