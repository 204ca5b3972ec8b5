"""The sharded ViT's wing: the model, its plan, its cost model, its report and its test strategies.

  plan.py         the plan decided once: rules table, checks, schedule, token split
  model.py        ``ShardedViT``: vit_ref's params on the mesh, the step inside one shard_map
  geometry.py     per-device sizes for the cost model
  cost.py         ``expected``: every collective of a step on paper (activation terms)
  cost_params.py  the parameter terms: DP sync, FSDP, ZeRO-1/2, token rows, clip norm
  report.py       compile a step, measure it, set it beside ``expected`` (``inspect``)
  strategies.py   hypothesis strategies drawing ViT configs and plans (tests only)

This package re-exports the names of ``plan`` and ``model`` that ``shardkit.models.vit``
offered when it was one module.
"""

from shardkit.models.vit.model import Layout, ShardedViT, make_layout
from shardkit.models.vit.plan import (
    EMBED_LEAVES,
    HEAD_LEAVES,
    RULES,
    TOKEN_FREE,
    TokenSplit,
    check_pipeline,
    check_plan,
    layer_order,
    param_axes,
    param_specs,
    row_leaves,
    rules,
    schedule,
    stacked,
    state_rules,
    state_specs,
    token_split,
    tokens_split,
    ulysses_factor,
    zero_replicated,
)

__all__ = [
    "EMBED_LEAVES",
    "HEAD_LEAVES",
    "RULES",
    "TOKEN_FREE",
    "Layout",
    "ShardedViT",
    "TokenSplit",
    "check_pipeline",
    "check_plan",
    "layer_order",
    "make_layout",
    "param_axes",
    "param_specs",
    "row_leaves",
    "rules",
    "schedule",
    "stacked",
    "state_rules",
    "state_specs",
    "token_split",
    "tokens_split",
    "ulysses_factor",
    "zero_replicated",
]
