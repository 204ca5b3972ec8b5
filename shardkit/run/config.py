"""From command-line values to a model and a checked plan: what every command needs before it
compiles anything (the CLI parses, this module decides).

``model_config`` builds the ViT from flag values over defaults; ``build`` makes the sharded
model of a plan (its plan checked once, there: one sentence on failure, ``PlanError``) and
checks the batch; ``check`` validates a plan without building anything; ``zero_note`` is the
note a user should see about leaves ZeRO keeps whole, if any.
"""

from __future__ import annotations

from typing import Any

import vit_ref
from shardkit.mesh import Plan
from shardkit.models.vit import ShardedViT, check_plan, zero_replicated


def model_config(
    overrides: dict[str, Any],
    variant: str | None,
    defaults: dict[str, Any],
    head_zeroinit: bool = False,
) -> vit_ref.ViTConfig:
    """The ViT of ``variant`` (big_vision's table) or of ``defaults``, with ``overrides`` (the
    flags given; None values ignored) on top."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if variant:
        return vit_ref.variant(variant, head_zeroinit=head_zeroinit, **given)
    return vit_ref.ViTConfig(**{**defaults, "head_zeroinit": head_zeroinit, **given})


def check(cfg: vit_ref.ViTConfig, plan: Plan, batch: int | None = None) -> str | None:
    """Raises ``PlanError`` (one sentence) if ``plan`` cannot run ``cfg`` at ``batch``;
    otherwise the note naming the leaves ZeRO keeps whole (not an error), or None."""
    check_plan(cfg, plan, batch)
    return zero_note(cfg, plan)


def build(cfg: vit_ref.ViTConfig, plan: Plan, batch: int, devices: Any = None) -> ShardedViT:
    """``ShardedViT(cfg, plan, devices)`` (which checks the plan) with ``batch`` checked too:
    every mistake a user can make, in one sentence, before anything compiles."""
    model = ShardedViT(cfg, plan, devices)
    model.check_batch(batch)
    return model


def zero_note(cfg: vit_ref.ViTConfig, plan: Plan) -> str | None:
    """The note naming the leaves a ZeRO level keeps whole (not an error), or None."""
    return zero_replicated(cfg, plan)
