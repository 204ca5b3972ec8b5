"""The cost model: the collectives one train step of ``ShardedViT`` must run, derived on paper.

``expected(cfg, plan, batch)`` lists, for one full step (forward + backward + update) of
``ShardedViT.train_step``, every collective it needs: kind, the mesh axes it spans, how many
times it runs per step and the bytes one device sends, each :class:`Term` with the reason it is
necessary. Nothing here compiles or measures anything: the numbers come from the config and the
plan alone, so comparing them with ``shardkit.ledger``'s measurement of the compiled program
(``shardkit.report``) is a real check, the "communication contract" of DESIGN.md.

Notation (scaling book; the dimension alphabet of ``vit_ref``)
  ``x[I_X, J]``: dim I split over mesh axis X; ``{U_X}``: an unreduced partial sum over X.
  n_data, n_seq, n_model: axis sizes. l layers, d width, f MLP hidden, h heads, k = d/h head
  dim, o classes, w = 4 bytes (float32 word).
  b = batch / n_data                     local batch
  T = patches (+ 1 class token for pool="tok"); S = the token-shard count (n_model for
  sp="megatron", n_seq for ring / Ulysses / USP, else 1); T' = T rounded up to a multiple of S
  (padding); t = T' / S local tokens.
  h_X = h / n_model local heads; A = b·t·d elements of one activation; E = b·t·h_X·k elements
  of one local q, k or v block.

Ring model, bytes SENT per device (DESIGN.md), V the bytes named:
  all-reduce 2(n−1)/n·V; all-gather (n−1)/n·V of its output; reduce-scatter (n−1)/n·V of its
  input; all-to-all (n−1)/n·V local; collective-permute V.

Per strategy (each ``_*_terms`` function states its own formulas and why each is the minimum):
  DP        AR_data of the gradients 2(n−1)/n·P·w; buckets by (sync axes, varying axes, dtype).
  ZeRO-1/2  RS_data of the gradients (ZeRO-2: per layer, in backward) + AG_data of the
            updated params: 2(n−1)/n·P·w (``_zero_terms``; ``zero1_terms`` for your own step).
  FSDP      per bucket AG_data forward, RS_data backward: 2(n−1)/n·P·w; with remat the block
            weights are gathered again in backward: ≈ 3(n−1)/n·P·w.
  TP        per block 2 AR_model forward (Megatron g) + 2 backward (Megatron f): 4·l·2(n−1)/n·A·w.
  Megatron-SP  the same bytes as 4 AG + 4 RS per block over the full sequence T'.
  ring      2(n−1) K/V hops forward; 2(n−1) K/V + 2n dK/dV hops backward, per block.
  Ulysses   4 all-to-alls (q, k, v, out) forward and 4 backward per block.
  USP       Ulysses over seq_ulysses (u) around a ring over seq_ring (r = n_seq / u).
Pipeline   (``plan.pp``; S stages, M microbatches, V chunks per stage, A_m = (b/M)·t·d·w one
          microbatch activation): one collective-permute over stage of A_m per direction per
          tick the engine sends in (``pipeline.Tables.sent``; GPipe 2(M+S−2)·A_m); ONE
          all-reduce over stage of the embedding's and the head's gradients and the loss; the
          layer terms above for M·l/S layers of b/M examples (the same bytes as l/S layers of
          b), zb's W repeating the backward's; pooling on the last stage only. Terms are per
          stage (``expected(..., stage=s)``; ``_pipeline_terms`` says why each is needed).
Clipping (``clip=True``): one scalar all-reduce over the whole mesh for the global norm.
Compositions add: every term depends only on the axes it uses.
Padding (T' > T) adds no collective: ring, Ulysses and USP mask the padded keys by position
(``num_valid``: each device computes any block's mask from the block's source position), so no
mask is ppermuted or all-gathered.

Op counts are those of the compiled CPU program. Where XLA's CPU pipeline merges or hoists
collectives, the term says so: the step-end all-reduces over the same devices (gradient buckets
and the loss) run as ONE combined op (the all-reduce combiner); and identical collectives left
outside loops are merged (CSE). Under
``plan.remat`` the rematerialised forward re-runs its collectives, except those whose results
the backward does not read. With remat on a one-layer model XLA merges an unpredictable part
of the re-run with the forward, so there the terms are an upper bound (``Expectation.exact``).
bfloat16 compute: CPU XLA widens bf16 collectives to float32, so every activation collective
is priced at 4 bytes per element on ``platform="cpu"``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from typing import Any

import jax

import vit_ref
from shardkit.comm.ledger import GROUPS, Collective, Tally, shift
from shardkit.mesh import AXES, Plan
from shardkit.models.vit import check_plan, param_axes, row_leaves, schedule, ulysses_factor
from shardkit.parallel import pipeline
from shardkit.parallel.sequence import SEQ_RING, SEQ_ULYSSES, USP_AXES

Axes = tuple[str, ...]
Key = tuple[str, Axes]
WORD = 4  # float32: params, gradients, residual stream, LayerNorm outputs
STEP_END = "step end"  # fusion group: XLA's combiner merges these all-reduces per device group


# ----------------------------------------------------------------------------- ring model


def all_reduce_bytes(v: float, n: int) -> float:
    """AllReduce of V bytes over n devices (reduce-scatter + all-gather): 2(n−1)/n · V."""
    return 2 * (n - 1) / n * v


def all_gather_bytes(v: float, n: int) -> float:
    """AllGather producing V bytes over n devices: (n−1)/n · V."""
    return (n - 1) / n * v


def reduce_scatter_bytes(v: float, n: int) -> float:
    """ReduceScatter of an input of V bytes over n devices: (n−1)/n · V."""
    return (n - 1) / n * v


def all_to_all_bytes(v: float, n: int) -> float:
    """AllToAll of V local bytes over n devices (each keeps 1/n): (n−1)/n · V."""
    return (n - 1) / n * v


def permute_bytes(v: float) -> float:
    """CollectivePermute of V bytes: every device sends its whole block once: V."""
    return float(v)


# ----------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class Term:
    """One expected collective (or a family of identical ones) of a step.

    Attributes:
      kind: a ``shardkit.ledger.KINDS`` name.
      axes: the mesh axes its device groups span, in mesh order.
      count: executions per step (a collective in the layer loop counts l times).
      bytes_sent: bytes one device sends over all ``count`` executions (ring model).
      what: what moves and why the step cannot do without it.
      phase: "forward", "backward", "recompute" (remat's second forward) or "step end".
      fused: terms with the same (kind, axes) and the same non-None ``fused`` group run as one
        op (XLA's all-reduce combiner); their counts are not added.
      pattern: how its devices are linked (``ledger.Collective.pattern``): ``GROUPS`` (the
        replica groups are the mesh's groups along ``axes``) or, for a permute, the shift.
    """

    kind: str
    axes: Axes
    count: int
    bytes_sent: float
    what: str
    phase: str
    fused: str | None = None
    pattern: str = GROUPS


@dataclasses.dataclass(frozen=True)
class Expectation:
    """The expected collectives of one train step: the contract the compiled program must meet.

    ``exact`` is False for remat on a one-layer model: with no layer loop left between them
    (JAX adds no CSE barrier to a remat inside ``scan``), XLA merges some of the re-run
    forward's collectives with the forward's, how many depending on its pass order. The terms
    are then an upper bound, and ``compare(..., exact=False)`` checks measured <= expected.
    """

    cfg: vit_ref.ViTConfig
    plan: Plan
    batch: int
    terms: tuple[Term, ...]

    @property
    def exact(self) -> bool:
        return not (self.plan.remat and self.cfg.depth == 1)

    def summary(self) -> dict[Key, Tally]:
        """(kind, axes) -> op executions per step and bytes sent per device (fused ops once)."""
        out: dict[Key, Tally] = {}
        seen: set[tuple[str, Axes, str]] = set()
        for term in self.terms:
            key = (term.kind, term.axes)
            count = term.count
            if term.fused is not None:
                count = 0 if (*key, term.fused) in seen else 1
                seen.add((*key, term.fused))
            t = out.get(key, Tally(0, 0.0))
            out[key] = Tally(t.count + count, t.bytes_sent + term.bytes_sent)
        return out

    def patterns(self) -> dict[Key, dict[str, Tally]]:
        """``summary`` split by pattern: (kind, axes) -> pattern -> ops and bytes."""
        return patterns_of(self.terms)

    def total_bytes_sent(self) -> float:
        """Bytes one device sends per step, over every collective."""
        return sum(term.bytes_sent for term in self.terms)

    def format(self) -> str:
        """One line per term: kind, axes, count, bytes, phase and why."""
        lines = [f"{'collective':<20}{'axes':<26}{'count':>7}{'bytes sent':>14}  phase: why"]
        for t in self.terms:
            axes = ",".join(t.axes) or "-"
            phase = t.phase + (" (fused)" if t.fused else "")
            lines.append(
                f"{t.kind:<20}{axes:<26}{t.count:>7}{t.bytes_sent:>14,.0f}  {phase}: {t.what}"
            )
        lines.append(f"{'total per device':<53}{self.total_bytes_sent():>14,.0f}")
        return "\n".join(lines)


def compare(
    expected: dict[Key, Tally],
    measured: dict[Key, Tally],
    rtol: float = 0.01,
    *,
    exact: bool = True,
) -> list[str]:
    """Where a measured summary breaks the contract: one sentence per (kind, axes), [] if none.

    The contract: the same (kind, axes) keys, equal op counts, and bytes within ``rtol``. With
    ``exact=False`` (``Expectation.exact``) the expectation is an upper bound: no unexpected
    keys, and counts and bytes at most the expected ones (bytes up to ``rtol`` above).
    """
    problems = []
    for key in sorted(set(expected) | set(measured)):
        want, got = expected.get(key, Tally(0, 0.0)), measured.get(key, Tally(0, 0.0))
        name = f"{key[0]} over {','.join(key[1]) or 'no axis'}"
        slack = rtol * max(want.bytes_sent, 1.0)
        over = got.bytes_sent - want.bytes_sent
        if got.count > want.count or (exact and got.count != want.count):
            problems.append(f"{name}: {got.count} ops measured, {want.count} expected.")
        if over > slack or (exact and -over > slack):
            problems.append(
                f"{name}: {got.bytes_sent:,.0f} bytes measured, {want.bytes_sent:,.0f} expected."
            )
    return problems


def patterns_of(terms: Iterable[Term] | Iterable[Any]) -> dict[Key, dict[str, Tally]]:
    """(kind, axes) -> pattern -> ops and bytes of the terms (fused ones once per group);
    ``contract.Expected`` records (never fused) count too."""
    out: dict[Key, dict[str, Tally]] = {}
    seen: set[tuple[str, Axes, str, str]] = set()
    for term in terms:
        key, fused = (term.kind, term.axes), getattr(term, "fused", None)
        count = term.count
        if fused is not None:
            count = 0 if (*key, term.pattern, fused) in seen else 1
            seen.add((*key, term.pattern, fused))
        by = out.setdefault(key, {})
        t = by.get(term.pattern, Tally(0, 0.0))
        by[term.pattern] = Tally(t.count + count, t.bytes_sent + term.bytes_sent)
    return out


def compare_patterns(
    expected: dict[Key, dict[str, Tally]],
    measured: dict[Key, dict[str, Tally]],
    collectives: Iterable[Collective],
    rtol: float = 0.01,
) -> list[str]:
    """Where the right amount moves the wrong way: one sentence per (kind, axes) whose total
    ops and bytes agree (``compare`` reports the rest) but whose split by pattern does not.

    The sentence names the expected and the measured patterns (ops and bytes of each) and the
    first measured op of a pattern the contract does not expect, with its source line.
    """
    ops = list(collectives)
    problems = []
    for key in sorted(set(expected) & set(measured)):
        want, got = expected[key], measured[key]
        by_pattern = (_agree(want.get(p), got.get(p), rtol) for p in set(want) | set(got))
        if not _agree(_sum(want), _sum(got), rtol) or all(by_pattern):
            continue
        mine = [c for c in ops if (c.kind, c.axes) == key]
        op = next((c for c in mine if c.pattern not in want), mine[0] if mine else None)
        where = "" if op is None else f" ({op.name}{f' at {op.source}' if op.source else ''}"
        where += "" if op is None else f" is {op.pattern})"
        problems.append(
            f"{key[0]} over {','.join(key[1])}: expected pattern {_patterns(want)}, measured "
            f"{_patterns(got)}{where}."
        )
    return problems


def _sum(by: dict[str, Tally]) -> Tally:
    return Tally(sum(t.count for t in by.values()), sum(t.bytes_sent for t in by.values()))


def _agree(want: Tally | None, got: Tally | None, rtol: float) -> bool:
    """Equal op counts and bytes within ``rtol`` (a missing tally is zero)."""
    w, g = want or Tally(0, 0.0), got or Tally(0, 0.0)
    return w.count == g.count and abs(w.bytes_sent - g.bytes_sent) <= rtol * max(w.bytes_sent, 1)


def _patterns(by: dict[str, Tally]) -> str:
    """``shift +1: 20 ops, 696,320 B; shift -1: 20 ops, 696,320 B``."""
    return "; ".join(f"{p}: {t.count} ops, {t.bytes_sent:,.0f} B" for p, t in sorted(by.items()))


# ----------------------------------------------------------------------------- geometry


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


def geometry(cfg: vit_ref.ViTConfig, plan: Plan, batch: int, platform: str = "cpu") -> Geometry:
    """The per-device sizes of (cfg, plan, batch); PlanError if the plan cannot run ``cfg``."""
    check_plan(cfg, plan, batch)
    sizes = dict(plan.mesh)
    mesh_axes: Axes = AXES
    token_axes: Axes = ()
    attention, ring, ulysses = "local", None, None
    n_seq = plan.size("seq")
    if n_seq > 1:
        token_axes = ("seq",)
        u = ulysses_factor(cfg, plan)
        attention = "ring" if u == 1 else "ulysses" if u == n_seq else "usp"
        ring = "seq" if attention == "ring" else SEQ_RING if attention == "usp" else None
        ulysses = "seq" if attention == "ulysses" else SEQ_ULYSSES if attention == "usp" else None
        if attention == "usp":
            mesh_axes, token_axes = USP_AXES, (SEQ_RING, SEQ_ULYSSES)
            sizes = {**sizes, SEQ_RING: n_seq // u, SEQ_ULYSSES: u}
    if plan.sp == "megatron":
        token_axes = (*token_axes, "model")
    act = WORD if platform == "cpu" or cfg.dtype == "float32" else 2
    return Geometry(cfg, plan, batch, mesh_axes, sizes, token_axes, attention, ring, ulysses, act)


# ----------------------------------------------------------------------------- the model


def expected(
    cfg: vit_ref.ViTConfig,
    plan: Plan,
    batch: int,
    *,
    platform: str = "cpu",
    clip: bool = False,
    stage: int | None = None,
) -> Expectation:
    """The collectives one ``ShardedViT.train_step`` must run for (cfg, plan, global batch).

    Args:
      cfg: the model.
      plan: mesh shape and strategies.
      batch: the global batch size.
      clip: the step clips to a global gradient norm (``train_step(clip_norm=...)``, as
        ``shardkit train`` runs it).
      platform: "cpu" (tested; bf16 collectives are widened to float32 there) or another
        backend name (activation collectives then move compute-dtype bytes; op counts are the
        CPU pipeline's and may differ where another backend combines collectives differently).
      stage: under a pipeline, the stage whose device the terms describe (default: the last,
        which also pools); stages differ only there.

    Returns:
      An :class:`Expectation` whose ``summary()`` is what ``Ledger.summary()`` must equal.
    """
    g = geometry(cfg, plan, batch, platform)
    if plan.pp == "none":
        body = [*_layer_terms(g), *_pool_terms(g), *_fsdp_terms(g), *_zero_terms(g)]
    else:
        last = plan.size("stage") - 1
        body = _pipeline_terms(g, last if stage is None else stage)
    terms = [
        *body,
        *_gradient_terms(g),
        *_loss_terms(g),
        *(_grad_norm_terms(g) if clip else []),
    ]
    return Expectation(cfg, plan, batch, tuple(terms))


def _layer_terms(g: Geometry) -> list[Term]:
    """The collectives inside the blocks: TP, Megatron-SP, ring, Ulysses / USP."""
    return [*_tp_terms(g), *_megatron_sp_terms(g), *_ring_terms(g), *_ulysses_terms(g)]


def _pipeline_terms(g: Geometry, stage: int) -> list[Term]:
    """A pipeline over ``stage`` (S stages, M microbatches, V chunks each), on one stage.

    Activations: each tick of a segment where some stage sends runs ONE collective-permute
    over stage of one microbatch activation A_m = (b/M)·t·d·w (x forward, +1), and likewise
    for the cotangent dy (−1): every device joins (bubble stages send zeros), so
      bytes = (ticks sending x + ticks sending dy) · A_m,
    read from the schedule's tables (``Tables.sent``): GPipe 2(M+S−2)·A_m, the minimum; the
    others a few zero sends more, since their steady state is one segment sending both ways.
    Nothing smaller can reach the next stage: it needs the whole activation of that
    microbatch.
    Layers: each stage runs its l/S layers forward on M microbatches of b/M examples and
    backward on each, so every per-layer term is that of M·l/S layers at batch b/M (the same
    bytes as l/S layers at b); zb's W pass re-runs the backward's collectives (the weight
    gradients need the cotangents inside the chunk, and each of them a collective), so its
    backward and recompute terms appear twice — except on stage 0, whose B computes only the
    first chunk's input gradient, which nothing but the embedding's weight gradient (in W)
    reads: XLA removes that B whole.
    Ends: the loss, the embedding's and the head's gradients are summed over stage once (ONE
    all-reduce; only the first and the last stage add to them); the pooled features are
    summed over the token axes on the last stage only, once per microbatch.
    FSDP: each device gathers its layers and the outer leaves once per step, before the
    schedule, and reduce-scatters their gradients once after it: one AG and one RS per bucket.
    """
    plan, micro = g.plan, g.plan.microbatches
    stages = plan.size("stage")
    depth = g.cfg.depth // stages * micro
    gm = dataclasses.replace(g, cfg=dataclasses.replace(g.cfg, depth=depth), batch=g.batch // micro)
    layers = _layer_terms(gm)
    if plan.pp == "zb" and stage > 0:  # stage 0's B is dead: only W needs chunk 0's dx
        layers += [
            dataclasses.replace(t, phase="weights (W)")
            for t in layers
            if t.phase in ("backward", "recompute")
        ]
    sent_x, sent_dy = pipeline.tables(schedule(plan)).sent()
    act = gm.b * g.t * g.cfg.dim * WORD
    permute = functools.partial(_term, g, "collective-permute", ["stage"])  # +1 / −1 below
    outer = [leaf for leaf in param_leaves(g) if not leaf.in_blocks]
    n_data = plan.size("data")
    ends = sum(leaf.local * (n_data if "data" in leaf.split else 1) for leaf in outer) + 1
    pool = [
        dataclasses.replace(t, count=t.count * micro, bytes_sent=t.bytes_sent * micro)
        for t in _pool_terms(gm)
    ]
    return [
        *layers,
        *permute(sent_x, act, "activation to the next stage", "forward", step=1),
        *permute(sent_dy, act, "cotangent to the previous stage", "backward", step=-1),
        *_term(
            g, "all-reduce", ["stage"], 1, all_reduce_bytes(ends * WORD, stages),
            "loss, embedding and head gradients from the first and last stage", STEP_END,
        ),
        *(pool if stage == stages - 1 else []),
        *_pipeline_fsdp_terms(g),
        *_zero_terms(g),
    ]  # fmt: skip


def _pipeline_fsdp_terms(g: Geometry) -> list[Term]:
    """FSDP under a pipeline: every FSDP-split leaf a device holds gathered once per step."""
    if g.plan.zero != 3:
        return []
    leaves = [leaf for leaf in param_leaves(g) if "data" in leaf.split]
    return [
        *_fsdp_group(g, "all-gather", leaves, 1, "this stage's layers and the ends", "forward"),
        *_fsdp_group(g, "reduce-scatter", leaves, 1, "their gradients", "backward"),
    ]


def _term(
    g: Geometry,
    kind: str,
    axes: Iterable[str],
    count: int,
    each: float,
    what: str,
    phase: str,
    step: int | None = None,
) -> list[Term]:
    """[Term] of ``count`` executions of ``each`` bytes, or [] when nothing runs; a permute
    shifts by ``step`` along ``axes``, every other kind runs on the axes' groups."""
    axes = g.order(axes)
    if count == 0 or not axes:
        return []
    n = math.prod(g.sizes[a] for a in axes)
    pattern = GROUPS if step is None else shift(step, n)
    return [Term(kind, axes, count, count * each, what, phase, pattern=pattern)]


def _tp_terms(g: Geometry) -> list[Term]:
    """Megatron tensor parallelism (``sp`` not "megatron"): X = model, A = b·t·d.

    Attention ``x[b, t, d] · W_qkv[d, h_X, k] -> ... · W_o[h_X, k, d] -> {U_X}`` and the MLP
    ``x · W1[d, f_X] -> gelu -> · W2[f_X, d] -> {U_X}`` each end in ONE AllReduce (Megatron g,
    forward) and start with ONE identity whose transpose is an AllReduce of the input's
    cotangent (Megatron f, backward). One f per region, not one per projection: q, k and v
    share one input, so their three partial cotangents are summed locally before the single
    reduction (naive autodiff reduces each: 3 instead of 1 in attention).
      forward  2·l × AR_X(A·w)      backward 2·l × AR_X(A·w)      = 4·l · 2(n−1)/n · A·w
    remat: the backward re-runs each block's forward, including attention's g, because LN2
    reads x + attention(x); the MLP's g is not re-run (nothing reads the block's output).
      recompute  l × AR_X(A·w)
    """
    n = g.plan.size("model")
    if n == 1 or g.plan.sp == "megatron":
        return []
    layers, a = g.cfg.depth, g.b * g.t * g.cfg.dim
    ar = functools.partial(_term, g, "all-reduce", ["model"])
    return [
        *ar(2 * layers, all_reduce_bytes(a * g.act, n), "Megatron g: sum {U_model}", "forward"),
        *ar(2 * layers, all_reduce_bytes(a * WORD, n), "Megatron f: sum cotangent", "backward"),
        *ar(layers * g.plan.remat, all_reduce_bytes(a * g.act, n), "attention g", "recompute"),
    ]


def _megatron_sp_terms(g: Geometry) -> list[Term]:
    """Megatron-SP: tokens split over X = model outside the TP regions, A' = b·T'_S·d.

    T'_S = T'/n_seq: with a seq axis the residual stream is split over (seq, model) and each
    region gathers only the model shards of its seq block (attention's ring / Ulysses over seq
    then moves the same blocks E as in the other sp modes: ``_ring_terms``, ``_ulysses_terms``).
    Each region enters with ``x[b, T'_SX, d] --AllGather--> x[b, T'_S, d]`` and exits with
    ``y[b, T'_S, d]{U_X} --ReduceScatter--> y[b, T'_SX, d]``: the bytes of Megatron's AllReduce
    (AR = RS + AG) while LayerNorm and the residual stream work on T'/(n_seq·n) tokens. Backward
    transposes each: AG <-> RS.
      forward  2·l × AG_X(A'·w) + 2·l × RS_X(A'·w);   backward the same: 8·l · (n−1)/n · A'·w
    remat: re-run attention's AG and RS (LN2 reads the residual) and the MLP's AG (the
    gradient of W1 reads the gathered input); the MLP's RS result is not read.
      recompute  2·l × AG + l × RS
    """
    n = g.plan.size("model")
    if g.plan.sp != "megatron":
        return []
    layers, full = g.cfg.depth, g.b * g.t_attn * g.cfg.dim
    ag = functools.partial(_term, g, "all-gather", ["model"])
    rs = functools.partial(_term, g, "reduce-scatter", ["model"])
    gather, scatter = all_gather_bytes(full * WORD, n), reduce_scatter_bytes(full * g.act, n)
    back_ag, back_rs = all_gather_bytes(full * g.act, n), reduce_scatter_bytes(full * WORD, n)
    remat = g.plan.remat
    return [
        *ag(2 * layers, gather, "gather token shards into each TP region", "forward"),
        *rs(2 * layers, scatter, "sum {U_model}, keep own tokens", "forward"),
        *ag(2 * layers, back_ag, "transpose of the exit reduce-scatter", "backward"),
        *rs(2 * layers, back_rs, "transpose of the entry all-gather", "backward"),
        *ag(2 * layers * remat, gather, "re-gather both regions' inputs", "recompute"),
        *rs(layers * remat, scatter, "attention exit (LN2 reads it)", "recompute"),
    ]


def _ring_terms(g: Geometry) -> list[Term]:
    """Ring attention over R (seq, or seq_ring in USP) of size r; blocks of E = b·t·h_X·k.

    ``q[b, T_R, h, k] · k, v[b, S_R, h, k]``: each device keeps its queries while the K and V
    blocks visit every device: r−1 hops each (a device already holds its own block), the
    fewest that bring every key to every query without an all-gather. Backward (hand-written,
    saving only q, k, v, out, lse) sends K, V round again (r−1 hops each) with float32 dK, dV
    accumulators that need r hops to return to their owner.
      forward  2·l·(r−1) × E·w;   backward 2·l·(r−1) × E·w + 2·l·r × E·4
    In USP the ring runs on h_X/u heads of u·t tokens: the same E.
    remat: the re-run forward sends K and V round again, 2·l·(r−1) hops; when r = 2 its one
    hop is the backward's first hop exactly (both loops have one trip and vanish), and XLA
    merges the two (0 extra). Likewise with l = 1 and r = 2 (no remat) no loop is left between
    the forward's hop and the backward's identical one: merged, 0 backward K/V hops.
    """
    if g.ring_axis is None:
        return []
    r, layers, e = g.sizes[g.ring_axis], g.cfg.depth, g.block
    # Every hop (K, V and the dK, dV accumulators) goes from ring position i to i + 1.
    hop = functools.partial(_term, g, "collective-permute", [g.ring_axis], step=1)
    redo = 2 * layers * (r - 1) if g.plan.remat and r > 2 else 0
    merged = layers == 1 and r == 2 and not g.plan.remat
    again = 0 if merged else 2 * layers * (r - 1)
    return [
        *hop(
            2 * layers * (r - 1), permute_bytes(e * g.act), "K, V blocks round the ring", "forward"
        ),
        *hop(again, permute_bytes(e * g.act), "K, V round again", "backward"),
        *hop(2 * layers * r, permute_bytes(e * WORD), "dK, dV accumulators home", "backward"),
        *hop(redo, permute_bytes(e * g.act), "K, V for the re-run forward", "recompute"),
    ]


def _ulysses_terms(g: Geometry) -> list[Term]:
    """Ulysses over U (seq, or seq_ulysses in USP) of size u; blocks of E = b·t·h_X·k.

    ``q, k, v[b, T_U, h, k] --AllToAll--> [b, T, h_U, k]`` (then attention, or USP's ring, on
    every token of h/u heads) and ``out --AllToAll--> out[b, T_U, h, k]``: the three inputs and
    the output each change split once; no other layout lets one device see all keys of a
    head without moving at least as much. Backward transposes each all-to-all. The lse
    all-to-all is dead code (the model drops lse) and is removed.
      forward 4·l × (u−1)/u·E·w; backward 4·l × the same; remat re-runs all four: + 4·l.
    """
    if g.ulysses_axis is None:
        return []
    u, layers = g.sizes[g.ulysses_axis], g.cfg.depth
    each = all_to_all_bytes(g.block * g.act, u)
    a2a = functools.partial(_term, g, "all-to-all", [g.ulysses_axis])
    return [
        *a2a(4 * layers, each, "q, k, v to a head split; out back", "forward"),
        *a2a(4 * layers, each, "transposed all-to-alls", "backward"),
        *a2a(4 * layers * g.plan.remat, each, "q, k, v, out of the re-run forward", "recompute"),
    ]


def _pool_terms(g: Geometry) -> list[Term]:
    """Pooling over split tokens: one AllReduce over the token axes of pooled[b, d].

    ``tok``: only the shard holding token 0 has the class token; ``gap``: each shard holds a
    partial sum of the valid tokens. Either way ``pooled[b, d]{U_S}`` -> psum: b·d·w, once.
    Its transpose (an invariant cotangent cast to varying) moves nothing.
    """
    return _term(
        g,
        "all-reduce",
        g.token_axes,
        1,
        all_reduce_bytes(g.b * g.cfg.dim * WORD, g.n(g.token_axes)),
        "pooled features from the token shards",
        "forward",
    )


def _loss_terms(g: Geometry) -> list[Term]:
    """The loss value for logging: psum over data of the per-shard sums (one float32)."""
    terms = _term(
        g,
        "all-reduce",
        ["data"],
        1,
        all_reduce_bytes(WORD, g.plan.size("data")),
        "loss value",
        STEP_END,
    )
    return [dataclasses.replace(t, fused=STEP_END) for t in terms]


def _grad_norm_terms(g: Geometry) -> list[Term]:
    """Clipping's global gradient norm (``data.global_norm``): ONE all-reduce of one float32
    over every mesh axis, 2(n−1)/n·w. Each device adds the squares of its shards (each divided
    by the copies of it in the mesh), the psum the rest; fewer than one scalar per device
    cannot reach every device. It reads every synced gradient, so it follows the step-end
    all-reduces and is never combined with them."""
    axes = [a for a in g.mesh_axes if g.sizes[a] > 1]
    each = all_reduce_bytes(WORD, g.n(axes))
    return _term(g, "all-reduce", axes, 1, each, "global gradient norm (clipping)", STEP_END)


# ----------------------------------------------------------------------------- parameters


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One param leaf as the plan places it.

    Attributes:
      path: keys from the root, e.g. ("blocks", "mlp", "fc1", "kernel").
      shape: the full shape (blocks stacked along a leading l axis).
      split: mesh axes that split it (``heads``, ``mlp`` -> model; ``embed`` -> data under
        ZeRO: the params themselves under ZeRO-3, their optimizer state and synced gradients
        under ZeRO-1/2).
      local: elements on one device (of the state under ZeRO-1/2).
    """

    path: tuple[str, ...]
    shape: tuple[int, ...]
    split: Axes
    local: int

    @property
    def in_blocks(self) -> bool:
        return self.path[0] == "blocks"


def param_leaves(g: Geometry) -> list[Leaf]:
    """Every param leaf of ``vit_ref.init(cfg)`` with its split under ``g.plan`` (no arrays)."""
    rules = {"heads": "model", "mlp": "model"}
    if g.plan.zero:  # ZeRO-1/2: the state and gradients; ZeRO-3: the params too
        rules["embed"] = "data"
    if g.plan.pp != "none":
        rules["layers"] = "stage"
    shapes = jax.eval_shape(lambda: vit_ref.init(jax.random.key(0), g.cfg))
    names = jax.tree.leaves(param_axes(g.cfg, g.plan), is_leaf=lambda x: isinstance(x, tuple))
    leaves = []
    for (path, shape), logical in zip(
        jax.tree_util.tree_leaves_with_path(shapes), names, strict=True
    ):
        axes = [rules.get(name) if name else None for name in logical]
        split = tuple(a for a in axes if a is not None and g.sizes[a] > 1)
        local = math.prod(
            d // (g.sizes[a] if a in split else 1) for d, a in zip(shape.shape, axes, strict=True)
        )
        leaves.append(Leaf(tuple(str(k.key) for k in path), tuple(shape.shape), split, local))
    return leaves


def sync_axes(g: Geometry, leaf: Leaf) -> Axes:
    """The axes a leaf's gradient is a partial sum over, all-reduced at the step's end.

    ``data``: every device of the data axis saw a different batch shard (FSDP-split leaves are
    reduce-scattered instead: the transpose of their all-gather). The token axes: every leaf
    but the head acts on token shards (the head sees pooled features, already summed over
    them); a leaf split over a token axis (Megatron-SP's model-split weights) is complete there.
    """
    axes = [] if "data" in leaf.split else ["data"]
    if leaf.path[0] != "head":
        axes += [a for a in g.token_axes if a not in leaf.split]
    return g.order(axes)


def _gradient_terms(g: Geometry) -> list[Term]:
    """Gradient sync: ``dw{U_axes} --AllReduce--> dw``, one bucket per group of leaves.

    A bucket holds the leaves that share (sync axes, varying axes, dtype) — the varying axes
    being the sync axes plus the axes that split the leaf, so model-split and model-replicated
    leaves never share a flat buffer — concatenated and reduced once: 2(n−1)/n · P_bucket·w
    with P_bucket the LOCAL elements. Each element must cross the group once in each ring
    phase, so no scheme sends fewer bytes. At the step's end all buckets over the same axes,
    and the loss over data, are independent, and XLA's all-reduce combiner runs them as ONE op.
    The token-indexed leaves (``_row_terms``) are not partial sums over the token axes: only
    their own rows' slice joins the buckets (over data).
    """
    rows = _row_leaves(g)
    buckets: dict[tuple[Axes, frozenset[str]], int] = {}
    for leaf in param_leaves(g):
        axes = sync_axes(g, leaf)
        size = leaf.local
        if leaf.path[0] in rows:
            axes = tuple(a for a in axes if a not in g.token_axes)
            size = size // leaf.shape[1] * g.t  # this shard's rows (cls and patches alike)
            if leaf.path[0] == "cls":
                continue  # one slice of [cls; pos_embedding] rows: counted with the patches
        if axes:
            varying = frozenset(axes) | frozenset(leaf.split)
            if leaf.path[0] in rows:
                varying |= frozenset(g.token_axes)
            buckets[(axes, varying)] = buckets.get((axes, varying), 0) + size
    terms = []
    for (axes, varying), size in buckets.items():
        what = f"gradient bucket of {size:,} elements varying over {','.join(sorted(varying))}"
        each = all_reduce_bytes(size * WORD, g.n(axes))
        terms.append(Term("all-reduce", axes, 1, each, what, STEP_END, fused=STEP_END))
    return [*terms, *_row_terms(g)]


def _row_leaves(g: Geometry) -> tuple[str, ...]:
    """``vit.row_leaves`` when tokens are split, else ()."""
    return row_leaves(g.cfg) if g.token_axes else ()


def _row_terms(g: Geometry) -> list[Term]:
    """The token-indexed gradients (``vit.row_leaves``: the learned position embedding and
    the class token) over the token axes: ``rows[T'_S, d] --AllGather--> rows[T', d]``.

    Each token shard's forward touched only its own t rows, so the shards' gradients are
    disjoint row slices, not partial sums: the sum is the concatenation, and each device needs
    the T' − t rows it lacks, (n−1)/n·T'·d·w (T' = T padded; the padded rows are zeros) — the
    minimum, against the all-reduce's 2(n−1)/n·T·d·w. One op after the step-end buckets.
    """
    rows = _row_leaves(g)
    if not rows:
        return []
    pos = next(leaf for leaf in param_leaves(g) if leaf.path[0] == "pos_embedding")
    width = pos.local // pos.shape[1]  # d, or d/n_data where ZeRO splits it
    whole = g.padded_tokens * width * WORD
    what = f"{' and '.join(rows)} gradient rows of each token shard"
    return _term(g, "all-gather", g.token_axes, 1, all_gather_bytes(whole, g.shards), what,
                 STEP_END)  # fmt: skip


def _fsdp_terms(g: Geometry) -> list[Term]:
    """FSDP (ZeRO-3) over data: ``w[d_data] --AllGather--> w[d]`` just before use, in buckets.

    ``data.fsdp_gather`` moves the split leaves as one flat buffer per bucket — the leaves
    sharing their varying axes (``fsdp_buckets``: with TP the model-split fragments and the
    model-replicated leaves; with tokens split, the head, which sees pooled features, apart
    from the leaves used on token shards) — so a bucket is ONE all-gather however many leaves
    it holds. Autodiff transposes
    each into ONE reduce-scatter of the bucket's gradients, so gradients arrive split, with no
    all-reduce. Block leaves are gathered inside the layer loop (l times, one layer's slice
    each); the gathered weights are kept for backward. With P_F the FSDP-split elements per
    device BEFORE the split (still model-split):
      forward AG (n−1)/n·P_F·w;  backward RS (n−1)/n·P_F·w;  ops: buckets (× l in the loop)
    remat: backward re-runs each block's forward and gathers its buckets again (a bucket is
    gathered whole: its leaves are read together), + (n−1)/n·P_blocks·w, ≈ 3(n−1)/n·P·w.
    """
    if g.plan.zero != 3:
        return []
    leaves = [leaf for leaf in param_leaves(g) if "data" in leaf.split]
    outer = [leaf for leaf in leaves if not leaf.in_blocks]
    blocks = [leaf for leaf in leaves if leaf.in_blocks]
    layers = g.cfg.depth
    return [
        *_fsdp_group(g, "all-gather", outer, 1, "embedding, norms, head", "forward"),
        *_fsdp_group(g, "reduce-scatter", outer, 1, "their gradients", "backward"),
        *_fsdp_group(g, "all-gather", blocks, layers, "block weights, per layer", "forward"),
        *_fsdp_group(g, "reduce-scatter", blocks, layers, "their gradients", "backward"),
        *_fsdp_group(g, "all-gather", blocks * g.plan.remat, layers, "block weights", "recompute"),
    ]


def _zero_terms(g: Geometry) -> list[Term]:
    """ZeRO-1 / ZeRO-2 over data (``plan.zero``): params replicated, state split.

    Every embed-split leaf's gradient ``dw[D]{U_data} --ReduceScatter--> dw[D_data]``: a device
    updates only its slice, so it needs only that slice's sum; then
    ``w[D_data] --AllGather--> w[D]``: every device needs every param for the next forward.
    (n−1)/n·P·w each, 2(n−1)/n·P·w together, one all-reduce's bytes: the minimum for a
    replicated param trained on split data. Leaves with no embed dim (biases over mlp or
    classes) stay in the all-reduce buckets (``_gradient_terms``).
    Ops: the reduce-scatters run in the gradients' buckets (``data.zero_scatter``, keyed like
    FSDP's by the varying axes: model-split or not, token-reduced or not); ZeRO-1 runs each
    once, after backward; ZeRO-2 runs the blocks' inside the layer loop, once per layer, in
    that layer's backward step (the outer leaves' once), so no layer's whole gradient outlives
    its step. The all-gathers after the update: one per set of split axes (the updated slices
    vary over data and the axes that split the param, nothing else). XLA's CPU pipeline
    combines neither.
    """
    if g.plan.zero not in (1, 2):
        return []
    n = g.plan.size("data")
    leaves = [leaf for leaf in param_leaves(g) if "data" in leaf.split]
    outer = [leaf for leaf in leaves if not leaf.in_blocks]
    blocks = [leaf for leaf in leaves if leaf.in_blocks]
    if g.plan.zero == 1:
        scatters = _fsdp_group(g, "reduce-scatter", leaves, 1, "gradient slices", STEP_END)
    else:
        scatters = [
            *_fsdp_group(g, "reduce-scatter", outer, 1, "outer gradient slices", "backward"),
            *_fsdp_group(
                g, "reduce-scatter", blocks, g.cfg.depth, "block gradient slices, per layer",
                "backward",
            ),
        ]  # fmt: skip
    gathered = all_gather_bytes(sum(leaf.local * n * WORD for leaf in leaves), n)
    count = len({frozenset(leaf.split) for leaf in leaves})
    gathers = _term(g, "all-gather", ["data"], count, gathered / count, "updated params", STEP_END)
    return [*scatters, *gathers]


def fsdp_buckets(g: Geometry, leaves: list[Leaf]) -> int:
    """How many flat buffers ``data.fsdp_gather`` makes of ``leaves``: one per set of varying
    axes of the fragments (the axes that split a leaf, plus the token axes it is cast to vary
    over because its gradient is a partial sum there; every ViT param is float32)."""
    return len({frozenset(leaf.split) | frozenset(sync_axes(g, leaf)) for leaf in leaves})


def _fsdp_group(
    g: Geometry, kind: str, leaves: list[Leaf], runs: int, what: str, phase: str
) -> list[Term]:
    """One term for the buckets of ``leaves``, each gathered (or scattered) ``runs`` times.

    A leaf's ``local`` elements times n is its gathered size; block leaves hold all l layers,
    so the sum is already the bytes of all ``runs``: (n−1)/n · Σ local·n·w.
    """
    n = g.plan.size("data")
    if not leaves:
        return []
    count = fsdp_buckets(g, leaves) * runs
    total = all_gather_bytes(sum(leaf.local * n * WORD for leaf in leaves), n)
    return _term(g, kind, ["data"], count, total / count, what, phase)


def zero1_terms(
    split_elements: int, replicated_elements: int, n: int, axis: str = "data"
) -> list[Term]:
    """ZeRO-1 (``data.zero1_update``): params replicated, optimizer state split over ``axis``.

    ``dw{U_X} --ReduceScatter--> dw[I_X]``, update the local slice with the local state, then
    ``w[I_X] --AllGather--> w[I]``: (n−1)/n·P·w + (n−1)/n·P·w = 2(n−1)/n·P·w, exactly one
    all-reduce's bytes, with 1/n of the optimizer state per device. Leaves that cannot be split
    (``replicated_elements``) are all-reduced whole. The formula for users of ``zero1_update`` in
    their own step (the ViT's ``--zero 1/2`` terms are ``_zero_terms``).

    Args:
      split_elements: elements of the leaves split over ``axis`` (full, before the split).
      replicated_elements: elements of the leaves updated whole.
      n: the size of ``axis``.
    """
    if n == 1:
        return []
    v, r = split_elements * WORD, replicated_elements * WORD
    terms = [
        Term("reduce-scatter", (axis,), 1, reduce_scatter_bytes(v, n), "gradient slices", STEP_END),
        Term("all-gather", (axis,), 1, all_gather_bytes(v, n), "updated param slices", STEP_END),
    ]
    if r:
        terms.append(Term("all-reduce", (axis,), 1, all_reduce_bytes(r, n), "unsplit", STEP_END))
    return terms
