"""Sharded == reference: one case at a time, or the default matrix of strategies.

For a (cfg, plan, batch) case this runs vit_ref and the sharded ViT on the same random params
(head drawn randomly, so logits depend on the body) and batch, and reports the worst
per-leaf relative L2 error of (1) the logits, (2) every gradient leaf, (3) every param after
one AdamW step. See ``shardkit.testing`` for the error definition. It also compiles the train
step and holds its collectives to ``models.vit.cost`` (counts equal, bytes within 1%): the
"sent MB" and "model MB" columns are bytes sent per device per step, measured and expected.

The optimizer is AdamW with eps=1e-3 instead of optax's 1e-8. Some gradients are analytically
zero (the key-projection bias: softmax ignores a per-query constant), so both runs hold only
float32 rounding noise there, and Adam's first step, lr·g/(|g| + eps), turns that noise into
updates of up to ±lr that differ between any two correct implementations. With eps=1e-3 the
noise moves those params by ~lr·1e-5 (measured: a 16-wide 2-layer model on data=2 × model=2
gives a step error of 1.1e-6, against 1.1e-5 with eps=1e-4), while real gradients still take
at least half an Adam step, so a wrong or missing update remains an error of order 1e-2.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import vit_ref
from shardkit.mesh import Plan, format_mesh
from shardkit.models.vit import ShardedViT, check_plan
from shardkit.models.vit.report import model_report
from shardkit.run.launch import beat
from shardkit.testing import comparison_optimizer, max_error, parity_precision

__all__ = [
    "Case",
    "CaseResult",
    "check_plan",
    "default_matrix",
    "format_header",
    "format_row",
    "prepare",
    "run_case",
    "run_cases",
]

TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-2}
# bf16 bound: both runs round matmul inputs to 8 mantissa bits (2^-9 ≈ 2e-3 relative) in a
# different order; over a few layers and the backward pass that compounds to ~1e-2.


def tolerance(cfg: vit_ref.ViTConfig, plan: Plan) -> float:
    """The bound for (cfg, plan): the model dtype's, or bf16's where the gradients travel in
    bf16 (``grad_sync``: each device's partial gradient rounded to 8 mantissa bits)."""
    return TOLERANCE["bfloat16" if plan.grad_sync == "bfloat16" else cfg.dtype]


def verify_optimizer() -> optax.GradientTransformation:
    """``testing.comparison_optimizer``: AdamW with eps 1e-3 (this module's docstring says why)."""
    return comparison_optimizer()


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    plan: Plan


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """Errors against vit_ref, and the compiled step's bytes against ``models.vit.cost``."""

    name: str
    plan: Plan
    errors: dict[str, float]
    tolerance: float
    measured_bytes: float
    expected_bytes: float
    contract_ok: bool

    @property
    def numerics_ok(self) -> bool:
        return all(e <= self.tolerance for e in self.errors.values())

    @property
    def ok(self) -> bool:
        return self.numerics_ok and self.contract_ok

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "mesh": format_mesh(self.plan.mesh),
            "sp": self.plan.sp,
            "fsdp": self.plan.fsdp,
            "zero": self.plan.zero,
            "pp": self.plan.pp,
            "microbatches": self.plan.microbatches,
            "virtual": self.plan.virtual,
            "kernel": self.plan.kernel,
            "ok": self.ok,
            "errors": self.errors,
            "tolerance": self.tolerance,
            "measured_bytes_sent": self.measured_bytes,
            "expected_bytes_sent": self.expected_bytes,
            "contract_ok": self.contract_ok,
        }


def default_matrix(devices: int = 8) -> list[Case]:
    """Every strategy on ``devices`` (8) CPU devices."""
    if devices != 8:
        return [Case("DP", Plan({"data": devices}))]
    return [
        Case("DP", Plan({"data": 8})),
        Case("TP", Plan({"model": 8})),
        Case("DP×TP", Plan({"data": 4, "model": 2})),
        Case("FSDP", Plan({"data": 8}, fsdp=True)),
        Case("FSDP×TP", Plan({"data": 4, "model": 2}, fsdp=True)),
        Case("FSDP remat", Plan({"data": 8}, fsdp=True, remat="full")),
        Case("ZeRO-1×TP", Plan({"data": 4, "model": 2}, zero=1)),
        Case("ZeRO-2×TP", Plan({"data": 4, "model": 2}, zero=2)),
        Case("Megatron-SP", Plan({"data": 2, "model": 4}, sp="megatron")),
        Case("ring", Plan({"data": 2, "seq": 4}, sp="ring")),
        Case("Ulysses", Plan({"data": 2, "seq": 4}, sp="ulysses")),
        Case("USP", Plan({"data": 2, "seq": 4}, sp="usp", ulysses=2)),
        Case("2×2×2 ring+TP+FSDP", Plan({"data": 2, "seq": 2, "model": 2}, sp="ring", fsdp=True)),
        Case("Megatron-SP×ring", Plan({"data": 2, "seq": 2, "model": 2}, sp="megatron")),
        Case("PP 1F1B×DP×TP", Plan({"data": 2, "stage": 2, "model": 2}, pp="1f1b", microbatches=4)),
        Case("PP ZB×Ulysses", Plan({"stage": 2, "seq": 4}, sp="ulysses", pp="zb", microbatches=2)),
    ]


def make_batch(cfg: vit_ref.ViTConfig, batch: int, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    k_img, k_lbl = jax.random.split(jax.random.key(seed))
    images = jax.random.normal(k_img, (batch, cfg.image, cfg.image, cfg.channels))
    return images, jax.random.randint(k_lbl, (batch,), 0, cfg.classes)


@functools.lru_cache(maxsize=8)
def _reference(cfg: vit_ref.ViTConfig, batch: int, seed: int) -> dict[str, Any]:
    params = vit_ref.init(jax.random.key(seed), dataclasses.replace(cfg, head_zeroinit=False))
    images, labels = make_batch(cfg, batch, seed + 1)
    logits, _ = jax.jit(vit_ref.forward, static_argnums=2)(params, images, cfg)
    grads = jax.jit(jax.grad(vit_ref.loss_fn), static_argnums=3)(params, images, labels, cfg)
    optimizer = verify_optimizer()
    copy = jax.tree.map(jnp.copy, params)
    stepped, _, _ = vit_ref.make_train_step(cfg, optimizer)(
        copy, optimizer.init(copy), images, labels
    )
    return dict(
        params=params, images=images, labels=labels, logits=logits, grads=grads, step=stepped
    )


def prepare(cfg: vit_ref.ViTConfig, cases: list[Case], batch: int) -> list[ShardedViT]:
    """The sharded model of every case, each plan checked once (as it is built) and the batch
    against it: a PlanError names the first bad case before anything compiles."""
    models = []
    for case in cases:
        models.append(ShardedViT(cfg, case.plan))
        models[-1].check_batch(batch)
    return models


def run_case(
    cfg: vit_ref.ViTConfig,
    case: Case,
    batch: int,
    seed: int = 0,
    model: ShardedViT | None = None,
) -> CaseResult:
    """Runs one case (on ``model``, built by ``prepare``, or a new one); raises PlanError
    before any compilation if the plan cannot work."""
    model = model or prepare(cfg, [case], batch)[0]
    with parity_precision():  # float32 means float32 on TPU too (shardkit.testing)
        return _run_case(cfg, case, batch, seed, model)


def _run_case(
    cfg: vit_ref.ViTConfig, case: Case, batch: int, seed: int, model: ShardedViT
) -> CaseResult:
    ref = _reference(cfg, batch, seed)
    params = model.shard(ref["params"])
    images, labels = model.shard_batch(ref["images"], ref["labels"])
    errors = {
        "logits": max_error(model.forward(params, images), ref["logits"]),
        "grads": max_error(
            model.to_reference(model.loss_and_grads(params, images, labels)[1]), ref["grads"]
        ),
    }
    optimizer = verify_optimizer()
    opt_state = model.init_opt_state(optimizer, params)
    stepped, _, _ = model.train_step(optimizer)(params, opt_state, images, labels)
    errors["step"] = max_error(model.to_reference(stepped), ref["step"])
    contract = model_report(model, batch, optimizer)
    return CaseResult(
        case.name,
        case.plan,
        errors,
        tolerance(cfg, case.plan),
        contract.measured_bytes_sent,
        contract.expected_bytes_sent,
        contract.contract_ok,
    )


_COLUMNS = "{:<{w}} {:<28} {:<9} {:<5} {:<17} {:>8} {:>8} {:>8} {:>6} {:>10} {:>10}  {}"


def format_header(width: int = 20) -> str:
    """The table's header; ``width``: the case column's (the longest case name)."""
    return _COLUMNS.format(
        "case", "mesh", "sp", "zero", "pp", "logits", "grads", "step", "tol", "sent MB",
        "model MB", "ok", w=width,
    )  # fmt: skip


def _pp(plan: Plan) -> str:
    """``1f1b M=4`` (``V=2`` too for interleaved), or ``-`` without a pipeline."""
    if plan.pp == "none":
        return "-"
    return f"{plan.pp} M={plan.microbatches}" + (f" V={plan.virtual}" if plan.virtual > 1 else "")


def format_row(r: CaseResult, width: int = 20) -> str:
    e = r.errors
    return _COLUMNS.format(
        r.name,
        format_mesh(r.plan.mesh),
        r.plan.sp,
        str(r.plan.zero),
        _pp(r.plan),
        f"{e['logits']:.1e}",
        f"{e['grads']:.1e}",
        f"{e['step']:.1e}",
        f"{r.tolerance:.0e}",
        f"{r.measured_bytes / 1e6:.3f}",
        f"{r.expected_bytes / 1e6:.3f}",
        ("✓" if r.numerics_ok else "✗ numerics") + ("" if r.contract_ok else " ✗ contract"),
        w=width,
    )


def run_cases(
    cfg: vit_ref.ViTConfig,
    cases: list[Case],
    batch: int,
    *,
    as_json: bool = False,
    echo: Callable[..., Any] = print,
    models: list[ShardedViT] | None = None,
) -> bool:
    """Runs every case in turn (``shardkit verify``): a table row per case as it finishes and
    a closing count, or one JSON object at the end; True when every case holds. ``models``:
    from ``prepare`` (built and checked here otherwise, before anything runs)."""
    models = models or prepare(cfg, cases, batch)
    width = max(20, *(len(case.name) for case in cases))
    if not as_json:
        echo(format_header(width), flush=True)
    results = []
    for case, model in zip(cases, models, strict=True):
        results.append(run_case(cfg, case, batch, model=model))
        beat()
        if not as_json:
            echo(format_row(results[-1], width), flush=True)
    ok = all(r.ok for r in results)
    if as_json:
        echo(json.dumps({"ok": ok, "cases": [r.to_json() for r in results]}))
    else:
        passed = sum(r.ok for r in results)
        used = sorted({r.plan.kernel for r in results})
        echo(f"{passed}/{len(results)} cases match vit_ref ({cfg.dtype}, batch {batch}; "
             f"kernel {', '.join(used)}).")  # fmt: skip
    return ok
