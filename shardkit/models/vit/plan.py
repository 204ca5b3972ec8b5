"""The ViT's plan, decided once: the logical-to-mesh rules table, every model-vs-plan check, the
pipeline schedule and layer order, and the token split (``token_split``: which axes split the
tokens and which attention core runs).

The model (``models.vit.model``), its cost model (``models.vit.cost``), reports and tests all
read these; none re-derives them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

import vit_ref
from shardkit.mesh import AXES, Plan, PlanError, logical_specs
from shardkit.models import sharded
from shardkit.parallel import pipeline
from shardkit.parallel import sequence as sp
from shardkit.parallel.pipeline import schedules

Params = dict[str, Any]

# Logical axis -> mesh axis. "embed" goes to data only under FSDP (see ``rules``).
RULES: dict[str, str] = {"heads": "model", "mlp": "model"}
# The leaves used only after the token reduction (pooling): their gradients are whole.
TOKEN_FREE = ("head",)
# Under a pipeline: the leaves chunk 0's prologue uses, and the last chunk's epilogue.
EMBED_LEAVES = ("embedding", "cls", "pos_embedding")
HEAD_LEAVES = ("encoder_norm", "head")


def rules(plan: Plan) -> dict[str, str]:
    """The logical-to-mesh axis table of the params for ``plan``; axes of size 1 split nothing.

    ``embed`` goes to data under FSDP (ZeRO-3) only."""
    return _table(plan, plan.zero == 3)


def state_rules(plan: Plan) -> dict[str, str]:
    """The table of the optimizer state and the synced gradients: ``rules`` plus ``embed``
    over data from ZeRO-1 up (a leaf with no embed dim, a bias over mlp or classes, is kept
    whole: ``zero_replicated``)."""
    return _table(plan, plan.zero >= 1)


def _table(plan: Plan, embed_over_data: bool) -> dict[str, str]:
    table = {**RULES, "embed": "data"} if embed_over_data else dict(RULES)
    if plan.pp != "none":
        table["layers"] = "stage"
    return {name: axis for name, axis in table.items() if plan.size(axis) > 1}


# ----------------------------------------------------------------------------- validation


def check_plan(cfg: vit_ref.ViTConfig, plan: Plan, batch: int | None = None) -> None:
    """Raises PlanError (one sentence: dimension, axis, sizes) if ``plan`` cannot run ``cfg``
    (with ``batch`` examples, if given). The rules that need no model are ``Plan``'s own,
    checked when it was built; these are the model's dims against the plan's axes."""
    _model_checks(cfg, plan)
    if batch is not None:
        check_batch(plan, batch)
        check_rows(cfg, plan, batch)


def check_rows(cfg: vit_ref.ViTConfig, plan: Plan, batch: int) -> None:
    """PlanError unless ``--overlap bidirectional`` can halve each device's token rows (local
    batch, per micro-batch, × local tokens): its rings carry half a block each way."""
    split = token_split(cfg, plan)
    tokens = split.padded_tokens(cfg.num_tokens) // split.shards
    rows = batch // plan.size("data") // plan.microbatches * tokens
    if plan.overlap == "bidirectional" and rows % 2:
        raise PlanError(
            f"--overlap bidirectional halves each device's {rows} token rows (local batch × "
            f"{tokens} tokens): give an even number."
        )


def _model_checks(cfg: vit_ref.ViTConfig, plan: Plan) -> None:
    """The model-vs-plan rules: each a dim of ``cfg`` that an axis of ``plan`` must divide."""
    data, seq, model = (plan.size(a) for a in ("data", "seq", "model"))
    checks = [
        (
            plan.size("expert") > 1,
            f"the ViT has no experts to split over expert={plan.size('expert')} (the expert "
            "axis is for mixture-of-experts models)",
        ),
        (cfg.heads % model, f"heads={cfg.heads} is not divisible by model={model}"),
        (cfg.mlp_dim % model, f"mlp_dim={cfg.mlp_dim} is not divisible by model={model}"),
        (
            plan.zero and cfg.dim % data,
            f"dim={cfg.dim} is not divisible by data={data} (ZeRO-{plan.zero} splits the embed "
            "axis over data)",
        ),
        (
            plan.sp == "ulysses" and (cfg.heads // model) % seq,
            f"sp='ulysses' needs the heads per model shard ({cfg.heads}//{model}="
            f"{cfg.heads // model}) divisible by seq={seq}",
        ),
    ]
    for failed, message in checks:
        if failed:
            raise PlanError(message + ".")
    if plan.sp in ("usp", "megatron") and seq > 1:
        ulysses_factor(cfg, plan)
    check_pipeline(cfg, plan)


def check_batch(plan: Plan, batch: int) -> None:
    """PlanError (one sentence) unless the global ``batch`` splits over data, the data-local
    batch into the microbatches (a pipeline's, or gradient accumulation's), and each
    micro-batch in two halves under ``Plan.halves``."""
    data, micro = plan.size("data"), plan.microbatches
    if batch % data:
        raise PlanError(f"batch={batch} is not divisible by data={data}.")
    local = batch // data
    if local % micro:
        raise PlanError(
            f"The data-local batch ({batch}//{data}={local}) is not divisible by "
            f"--microbatches {micro}."
        )
    if plan.halves and (local // micro) % 2:
        raise PlanError(
            f"--overlap with plain TP runs each device's batch as two halves, and its "
            f"batch of {local // micro} does not halve; give an even batch per data shard."
        )


def check_pipeline(cfg: vit_ref.ViTConfig, plan: Plan) -> None:
    """PlanError (one sentence) unless the depth, the schedule and the sequence mode fit the
    pipeline (the stage axis, the schedule name and ``--virtual`` are ``Plan``'s rules)."""
    if plan.pp == "none":
        return
    stages, virtual = plan.size("stage"), plan.virtual
    if cfg.depth % (stages * virtual):
        raise PlanError(
            f"depth={cfg.depth} is not divisible by stage×virtual = {stages}×{virtual} "
            "(every chunk holds the same number of layers)."
        )
    schedules.build(plan.pp, stages, plan.microbatches, virtual)  # M vs S, V vs the schedule


def schedule(cfg: vit_ref.ViTConfig, plan: Plan) -> schedules.Schedule:
    """The pipeline schedule of ``plan`` (stage > 1), in the form the engine runs it: uniform
    (``schedules.uniform``) when a ring over seq puts a ppermute inside every chunk, else
    phased (``schedules.phased``: GPipe as built)."""
    built = schedules.build(plan.pp, plan.size("stage"), plan.microbatches, plan.virtual)
    ring = plan.size("seq") > ulysses_factor(cfg, plan)
    return schedules.uniform(built) if ring else schedules.phased(built)


def layer_order(cfg: vit_ref.ViTConfig, plan: Plan) -> np.ndarray:
    """order[p] = the vit_ref layer stored at position p of the stacked blocks
    (``pipeline.layer_order`` of the depth over the plan's stages and virtual chunks)."""
    return pipeline.layer_order(cfg.depth, plan.size("stage"), plan.virtual, plan.pp == "zbv")


def ulysses_factor(cfg: vit_ref.ViTConfig, plan: Plan) -> int:
    """The Ulysses degree u of the seq axis (the ring runs over the other seq/u).

    ``usp``: ``--ulysses`` or the largest u the local heads allow; ``ulysses``: the whole seq
    axis; ``megatron`` over seq: a ring (u = 1) unless ``--ulysses`` says otherwise; others 1.
    """
    seq, heads_local = plan.size("seq"), cfg.heads // plan.size("model")
    if plan.sp == "ulysses":
        return seq
    if plan.sp == "usp" or (plan.sp == "megatron" and plan.ulysses is not None):
        return sp.usp_factor(seq, heads_local, plan.ulysses)
    return 1


@dataclasses.dataclass(frozen=True)
class TokenSplit:
    """The plan's sequence decision, made once: every reader (the model's ``Layout``, the cost
    model's ``Geometry``, reports, tests) takes it from ``token_split``.

    Attributes:
      attention: the core run on local heads: "local", "ring", "ulysses" or "usp".
      ulysses: the Ulysses degree u of the seq axis (1: none).
      mesh_axes: the axis names of the mesh the step runs on (USP splits seq in two).
      sizes: axis name -> size on that mesh.
      token_axes: mesh axes the tokens are split over, major first (may be empty);
        Megatron-SP adds ``model`` last.
      ring_axis / ulysses_axis: the axes of the ring and of the Ulysses all-to-alls, or None.
    """

    attention: str
    ulysses: int
    mesh_axes: tuple[str, ...]
    sizes: dict[str, int]
    token_axes: tuple[str, ...]
    ring_axis: str | None
    ulysses_axis: str | None

    @property
    def shards(self) -> int:
        return math.prod(self.sizes[a] for a in self.token_axes)

    def padded_tokens(self, num_tokens: int) -> int:
        """``num_tokens`` rounded up to a multiple of the token-shard count."""
        return -(-num_tokens // self.shards) * self.shards


def token_split(cfg: vit_ref.ViTConfig, plan: Plan) -> TokenSplit:
    """How ``plan`` splits the tokens of ``cfg`` and which attention core runs (unchecked:
    ``check_plan`` first)."""
    n_seq, u = plan.size("seq"), ulysses_factor(cfg, plan)
    sizes = dict(plan.mesh)
    mesh_axes: tuple[str, ...] = AXES
    token_axes: tuple[str, ...] = ()
    attention, ring, uly = "local", None, None
    if n_seq > 1:
        # Degenerate factors are the pure modes; only a true hybrid needs the split mesh.
        attention = "ring" if u == 1 else "ulysses" if u == n_seq else "usp"
        token_axes, ring, uly = ("seq",), "seq", "seq"
        if attention == "usp":
            mesh_axes, token_axes = sp.USP_AXES, sp.USP_SEQ
            ring, uly = sp.SEQ_RING, sp.SEQ_ULYSSES
            sizes = {**sizes, sp.SEQ_RING: n_seq // u, sp.SEQ_ULYSSES: u}
        ring = None if attention == "ulysses" else ring
        uly = None if attention == "ring" else uly
    if plan.sp == "megatron":  # tokens also split over model outside the TP regions (minor)
        token_axes = (*token_axes, "model")
    return TokenSplit(attention, u, mesh_axes, sizes, token_axes, ring, uly)


def tokens_split(plan: Plan) -> bool:
    """Whether ``plan`` splits the token dim (sequence parallelism, or Megatron-SP over model)."""
    return plan.size("seq") > 1 or (plan.sp == "megatron" and plan.size("model") > 1)


def row_leaves(cfg: vit_ref.ViTConfig) -> tuple[str, ...]:
    """The leaves indexed by token position: the learned position embedding (patch rows) and
    with it the class token (row 0 under ``pool="tok"``). Split over token shards, their
    gradients are disjoint row slices, not partial sums (``ShardedViT.sync_grads_local``).
    A fixed sincos2d embedding leaves the class token alone: one row, all-reduced with the
    rest."""
    if cfg.posemb != "learn":
        return ()
    return ("cls", "pos_embedding") if cfg.pool == "tok" else ("pos_embedding",)


def param_axes(cfg: vit_ref.ViTConfig, plan: Plan) -> Params:
    """``vit_ref.param_axes`` in the plan's form of the blocks (a list of per-layer trees
    under ``layers="list"``, else stacked), except under FSDP (ZeRO-3) with tokens split,
    where the row leaves (``row_leaves``) stay whole instead of split over data: each token
    shard's gradient there is its own rows, gathered over the token axes; split over data,
    every row would be gathered and reduce-scattered over data too (2(n_d−1)/n_d·T·d·w where
    t rows carry anything). Their params are T·d + d floats."""
    axes = vit_ref.param_axes(cfg, plan.layers)
    if plan.zero != 3 or not tokens_split(plan):
        return axes
    whole = {
        name: tuple(None if a == "embed" else a for a in axes[name]) for name in row_leaves(cfg)
    }
    return {**axes, **whole}


def stacked(plan: Plan) -> Plan:
    """``plan`` with its blocks stacked (``layers="list"`` run unrolled over the stack): the
    same collectives, for readers of the stacked tree (the cost model, XLA's own step)."""
    return dataclasses.replace(plan, layers="unrolled") if plan.layers == "list" else plan


def param_specs(cfg: vit_ref.ViTConfig, plan: Plan) -> Params:
    """PartitionSpecs of every param leaf, from ``param_axes`` and ``rules(plan)``."""
    return logical_specs(param_axes(cfg, plan), rules(plan))


def state_specs(cfg: vit_ref.ViTConfig, plan: Plan) -> Params:
    """PartitionSpecs of the optimizer state's param-shaped leaves (``state_rules(plan)``)."""
    return logical_specs(param_axes(cfg, plan), state_rules(plan))


def zero_replicated(cfg: vit_ref.ViTConfig, plan: Plan) -> str | None:
    """One sentence naming the leaves a ZeRO level keeps whole on every device (not an error:
    the right call), or None. ZeRO-1/2: those with no embed dim for data to split, with their
    optimizer state (small). FSDP with tokens split: the row leaves (``param_axes`` says why)."""
    shapes = jax.eval_shape(lambda: vit_ref.init(jax.random.key(0), cfg))
    sizes = {sharded.leaf_path(path): shape.size
             for path, shape in jax.tree_util.tree_leaves_with_path(shapes)}  # fmt: skip
    total = sum(sizes.values())
    if plan.zero in (1, 2):
        names = jax.tree.leaves(vit_ref.param_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))
        whole = [name for name, logical in zip(sizes, names, strict=True) if "embed" not in logical]
        why = (
            f"with their optimizer state{' and gradients' if plan.zero == 2 else ''}, as they "
            "have no embed dim for data to split"
        )
    elif plan.zero == 3 and tokens_split(plan):
        whole = [name for name in row_leaves(cfg) if name in sizes]
        why = (
            "as with tokens split each token shard's gradient is its own rows, gathered over the "
            "token axes, where a split over data would gather and reduce-scatter every row"
        )
    else:
        return None
    if not whole:
        return None
    kept = sum(sizes[name] for name in whole)
    return (
        f"ZeRO-{plan.zero} keeps {len(whole)} leaves whole on every device, {why}: "
        f"{', '.join(whole)} ({kept:,} of {total:,} params, {kept / total:.1%})."
    )
