"""The ViT's communication report: compile ``ShardedViT``'s full train step (forward, backward
and AdamW update; compiled, never run), measure it (``comm.ledger``) and set it beside
``models.vit.cost``'s expectation (``comm.report.Report``).

``inspect(cfg, plan, batch)`` is ``shardkit inspect``; ``model_report`` reports an existing
model (the one ``verify`` just ran); ``report_of`` builds the report of a measured ledger, one
per stage under a pipeline (``staged.stage_ledger`` counts each branch collective by the ticks a
stage spends in it).

Arguments are abstract (``jax.ShapeDtypeStruct`` carrying the shardings ``ShardedViT.shard``
and ``init_opt_state`` would give), so no params are drawn and no array is allocated: the
compiled program depends only on shapes, dtypes and shardings.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vit_ref
from shardkit.comm.ledger import Ledger, Narrowing, measure, widened
from shardkit.comm.report import Report
from shardkit.mesh import Plan
from shardkit.models.staged import stage_report
from shardkit.models.vit import cost
from shardkit.models.vit.model import ShardedViT
from shardkit.models.vit.plan import schedule
from shardkit.parallel import data as dp


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
    return abstract_step_args(
        model.cfg, *specs, model.sharding, model.batch_spec, batch, optimizer, model.plan.layers
    )


def abstract_step_args(
    cfg: vit_ref.ViTConfig,
    specs: Any,
    state_specs: Any,
    sharding: Callable[[P], NamedSharding],
    batch_spec: P,
    batch: int,
    optimizer: optax.GradientTransformation,
    layers: str = "scan",
) -> tuple[Any, ...]:
    """Abstract step arguments with ``specs``' shardings, the blocks in the form ``layers``
    runs (``vit_ref.as_layers``)."""
    shapes = jax.eval_shape(lambda: vit_ref.as_layers(vit_ref.init(jax.random.key(0), cfg), layers))
    params = _abstract(shapes, jax.tree.map(sharding, specs))
    opt_state = _abstract(*dp.opt_state_layout(optimizer, shapes, state_specs, sharding))
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
    compiler_options: dict[str, str] | None = None,
) -> Ledger:
    """The ledger of ``model.train_step(optimizer, clip_norm)`` compiled for a global ``batch``
    (with ``compiler_options``, e.g. libtpu's flags, when given)."""
    optimizer = optimizer or default_optimizer()
    args = step_args(model, batch, optimizer)
    step = model.train_step(optimizer, clip_norm)
    return measure(step, *args, mesh=model.mesh, compiler_options=compiler_options)


def model_report(
    model: ShardedViT,
    batch: int,
    optimizer: optax.GradientTransformation | None = None,
    clip_norm: float | None = None,
) -> Report:
    """The contract report of an existing ``ShardedViT`` (e.g. the one ``verify`` just ran, or
    the clipped step ``shardkit train`` runs)."""
    ledger = measure_step(model, batch, optimizer, clip_norm)
    clip = clip_norm is not None
    lay = model.layout
    return report_of(
        ledger, model.cfg, model.plan, batch, clip=clip, split=lay.split, tiles=lay.fsdp_tiles
    )


def report_of(
    ledger: Ledger, cfg: vit_ref.ViTConfig, plan: Plan, batch: int, **kwargs: Any
) -> Report:
    """The report of a measured step; under a pipeline one per stage (the last one shown)."""
    if plan.pp == "none":
        return Report(ledger, cost.expected(cfg, plan, batch, **kwargs))
    return stage_report(
        ledger, schedule(cfg, plan), lambda s: cost.expected(cfg, plan, batch, stage=s, **kwargs)
    )


def inspect(
    cfg: vit_ref.ViTConfig,
    plan: Plan,
    batch: int,
    *,
    hlo_path: str | pathlib.Path | None = None,
    platform: str = "cpu",
) -> Report:
    """Compiles ``ShardedViT(cfg, plan)``'s train step and holds it to ``models.vit.cost``.

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
    model = ShardedViT(cfg, plan)  # checks the plan, before anything compiles
    return model_inspect(model, batch, hlo_path=hlo_path, platform=platform)


def _fsdp_gathers_widened(ledger: Ledger) -> tuple[Ledger, Narrowing]:
    """A 16-bit model's FSDP step with its float32 param all-gathers counted as written: the
    TPU compiler may move the cast to the compute dtype before a gather whose weights only
    the matmuls read (ViT-B/16 FSDP×TP: half the bytes); nothing else over data is 16-bit."""
    param = [c.kind == "all-gather" and c.axes == ("data",) for c in ledger.collectives]
    gathers = tuple(c for c, p in zip(ledger.collectives, param, strict=True) if p)
    wide, narrowed = widened(dataclasses.replace(ledger, collectives=gathers), "f32")
    each = iter(wide.collectives)  # in the program's order, as parsed
    out = tuple(next(each) if p else c for c, p in zip(ledger.collectives, param, strict=True))
    return dataclasses.replace(ledger, collectives=out), narrowed


def model_inspect(
    model: ShardedViT,
    batch: int,
    *,
    hlo_path: str | pathlib.Path | None = None,
    platform: str = "cpu",
    compiler_options: dict[str, str] | None = None,
) -> Report:
    """``inspect`` of a model already built (its plan checked once, when it was built)."""
    ledger = measure_step(model, batch, compiler_options=compiler_options)
    narrowed = Narrowing()
    if hlo_path is not None:
        pathlib.Path(hlo_path).write_text(ledger.hlo)
    if platform == "tpu" and model.cfg.dtype == "float32":  # the compiler's bf16 rounding
        bf16_sync = ("all-reduce",) if model.plan.grad_sync == "bfloat16" else ()
        ledger, narrowed = widened(ledger, "f32", bf16_sync)
    elif platform == "tpu" and model.plan.fsdp:
        ledger, narrowed = _fsdp_gathers_widened(ledger)
    result = report_of(
        ledger,
        model.cfg,
        model.plan,
        batch,
        platform=platform,
        split=model.layout.split,
        tiles=model.layout.fsdp_tiles,
    )
    if platform == "tpu":  # its combine threshold may keep fused step-end all-reduces apart
        others = tuple((s, dataclasses.replace(r, apart_ok=True)) for s, r in result.others)
        result = dataclasses.replace(result, apart_ok=True, others=others)
    return dataclasses.replace(result, narrowed=narrowed)
