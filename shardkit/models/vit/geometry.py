"""Per-device sizes of one ViT train step, derived once from (cfg, plan, batch).

``geometry(cfg, plan, batch)`` reads the plan's token-split decision (``plan.token_split``:
the same one ``ShardedViT`` runs on) and gives the cost model the per-device numbers its
formulas need (notation: ``models.vit.cost``). ``term`` builds one ``comm.terms.Term`` on
those axes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import vit_ref
from shardkit.comm.ledger import GROUPS, shift
from shardkit.comm.terms import Term
from shardkit.mesh import Plan
from shardkit.models.vit.plan import TokenSplit, check_batch, check_plan, token_split
from shardkit.parallel.tiles import Tiles

Axes = tuple[str, ...]
WORD = 4  # float32: params, gradients, residual stream, LayerNorm outputs
STEP_END = "step end"  # fusion group: XLA's combiner merges these all-reduces per device group


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Everything the formulas need, per device, derived from (cfg, plan, batch).

    Attributes:
      mesh_axes: the axis names of the mesh the step runs on, in order (USP splits seq).
      sizes: axis name -> size on that mesh.
      token_axes: the axes tokens are split over, major first; S their size product.
      attention: "local", "ring", "ulysses" or "usp" (as ``ShardedViT`` resolves the plan).
      ring_axis / ulysses_axis: the axes of the ring and of the Ulysses all-to-alls (or None).
      act: bytes per element of an activation collective (4 on CPU, see module docstring).
      fsdp_tiles: FSDP's and ZeRO's buckets travel as tiles (on a TPU: ``parallel.tiles``).
      grad_word: bytes per element of a gradient all-reduce (2 with ``grad_sync="bfloat16"``
        off the CPU, whose all-reduces widen bf16 to float32).
    """

    cfg: vit_ref.ViTConfig
    plan: Plan
    batch: int
    mesh_axes: Axes
    sizes: dict[str, int]
    token_axes: Axes
    attention: str
    ring_axis: str | None
    ulysses_axis: str | None
    act: int
    fsdp_tiles: Tiles | None = None
    grad_word: int = WORD

    @property
    def b(self) -> int:
        return self.batch // self.plan.size("data")

    @property
    def shards(self) -> int:
        return math.prod(self.sizes[a] for a in self.token_axes)

    @property
    def padded_tokens(self) -> int:
        return -(-self.cfg.num_tokens // self.shards) * self.shards

    @property
    def t(self) -> int:
        return self.padded_tokens // self.shards

    @property
    def padded(self) -> bool:
        return self.padded_tokens != self.cfg.num_tokens

    @property
    def t_attn(self) -> int:
        """Tokens per device inside attention: t, times n_model under Megatron-SP (gathered)."""
        return self.t * (self.sizes["model"] if self.plan.sp == "megatron" else 1)

    @property
    def block(self) -> int:
        """E = b·t_attn·h_X·k: elements of one local q, k or v block (and of out)."""
        heads = self.cfg.heads // self.plan.size("model")
        return self.b * self.t_attn * heads * self.cfg.head_dim

    def n(self, axes: Iterable[str]) -> int:
        return math.prod(self.sizes[a] for a in axes)

    def order(self, axes: Iterable[str]) -> Axes:
        """``axes`` in mesh order, axes of size 1 dropped (a group over them is one device)."""
        wanted = set(axes)
        return tuple(a for a in self.mesh_axes if a in wanted and self.sizes[a] > 1)


def geometry(
    cfg: vit_ref.ViTConfig,
    plan: Plan,
    batch: int,
    platform: str = "cpu",
    split: TokenSplit | None = None,
    tiles: Tiles | None = None,
) -> Geometry:
    """The per-device sizes of (cfg, plan, batch); PlanError if the plan cannot run ``cfg``.

    ``split``: the token split of a model already built on (cfg, plan) (``ShardedViT.layout.split``,
    made once its plan was checked): then only the batch is checked here. ``tiles``: the
    model's FSDP / ZeRO bucket tiles (``Layout.fsdp_tiles``); on paper, "tpu" takes the fewest.
    """
    if split is None:
        check_plan(cfg, plan, batch)
        split = token_split(cfg, plan)
    else:
        check_batch(plan, batch)
    act = WORD if platform == "cpu" or cfg.dtype == "float32" else 2
    return Geometry(
        cfg, plan, batch, split.mesh_axes, split.sizes, split.token_axes, split.attention,
        split.ring_axis, split.ulysses_axis, act,
        tiles if tiles is not None or platform != "tpu" else Tiles(),
        2 if plan.grad_sync == "bfloat16" and platform != "cpu" else WORD,
    )  # fmt: skip


def term(
    g: Geometry,
    kind: str,
    axes: Iterable[str],
    count: int,
    each: float,
    what: str,
    phase: str,
    step: int | None = None,
    pattern: str | None = None,
) -> list[Term]:
    """[Term] of ``count`` executions of ``each`` bytes, or [] when nothing runs; a permute
    shifts by ``step`` along ``axes`` (or links devices as ``pattern`` says), every other kind
    runs on the axes' groups."""
    axes = g.order(axes)
    if count == 0 or not axes:
        return []
    n = math.prod(g.sizes[a] for a in axes)
    if pattern is None:
        pattern = GROUPS if step is None else shift(step, n)
    return [Term(kind, axes, count, count * each, what, phase, pattern=pattern)]
