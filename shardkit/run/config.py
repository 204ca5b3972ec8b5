"""From command-line values to a model and a checked plan: what every command needs before it
compiles anything (the CLI parses, this module decides).

``model_config`` builds the ViT from flag values over defaults; ``check`` validates a plan
against it (one sentence on failure, ``PlanError``) and returns the note a user should see
about leaves ZeRO keeps whole, if any.
"""

from __future__ import annotations

from typing import Any

import vit_ref
from shardkit.mesh import Plan
from shardkit.models.vit import check_plan, zero_replicated


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
    return zero_replicated(cfg, plan)
