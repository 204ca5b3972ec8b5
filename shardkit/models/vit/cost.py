"""The cost model: the collectives one train step of ``ShardedViT`` must run, derived on paper.

``expected(cfg, plan, batch)`` lists, for one full step (forward + backward + update) of
``ShardedViT.train_step``, every collective it needs: kind, the mesh axes it spans, how many
times it runs per step and the bytes one device sends, each :class:`Term` with the reason it is
necessary. Nothing here compiles or measures anything: the numbers come from the config and the
plan alone, so comparing them with ``comm.ledger``'s measurement of the compiled program
(``models.vit.report``) is a real check, the "communication contract" of DESIGN.md.

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
          b), under every schedule (zb's B and W share them out); pooling on the last stage
          only. Terms are per
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
the backward does not read. With remat and no layer loop XLA merges an unpredictable part
of the re-run with the forward, so there the terms are an upper bound (``Expectation.exact``).
bfloat16 compute: CPU XLA widens bf16 collectives to float32, so every activation collective
is priced at 4 bytes per element on ``platform="cpu"``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh

import vit_ref
from shardkit.comm.bytes import (
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
    permute_bytes,
    reduce_scatter_bytes,
)
from shardkit.comm.ledger import pattern_of
from shardkit.comm.terms import Expectation, Term
from shardkit.mesh import Plan, format_mesh
from shardkit.models.vit import cost_params as pc
from shardkit.models.vit.geometry import STEP_END, WORD, Geometry, geometry, term
from shardkit.models.vit.plan import TokenSplit, schedule
from shardkit.parallel import pipeline
from shardkit.parallel.tiles import Tiles


def loopless(cfg: vit_ref.ViTConfig, plan: Plan) -> bool:
    """Whether the compiled step has no layer loop: one layer, or the layers unrolled."""
    return cfg.depth == 1 or plan.unrolled


def unlooped_layers(cfg: vit_ref.ViTConfig, plan: Plan) -> int:
    """How many layers the compiled step runs outside a layer loop: all when ``loopless``;
    with ``overlap`` over FSDP, ZeRO-2 or DP's sync (``data.prefetch_layers``) the last layer
    runs after a loop of depth − 1 trips, which XLA removes when it has one trip; else none."""
    if loopless(cfg, plan):
        return cfg.depth
    if plan.prefetches_layers:
        return cfg.depth if cfg.depth == 2 else 1
    return 0


@dataclasses.dataclass(frozen=True)
class ViTExpectation(Expectation):
    """The expected collectives of one ``ShardedViT`` train step for (cfg, plan, batch).

    ``exact`` is False for remat without a layer loop (one layer, or ``plan.layers`` unrolled):
    with no loop left between them (JAX adds no CSE barrier to a remat inside ``scan``), XLA
    merges some of the re-run forward's collectives with the forward's, how many depending on
    its pass order. The terms are then an upper bound, and ``compare(..., exact=False)``
    checks measured <= expected.
    """

    cfg: vit_ref.ViTConfig
    plan: Plan
    batch: int
    sizes: tuple[tuple[str, int], ...] = ()  # the step's mesh (USP splits seq), in order

    @property
    def exact(self) -> bool:
        return not (self.plan.recompute and loopless(self.cfg, self.plan))

    @property
    def bound_why(self) -> str:
        return "remat without a layer loop"

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def title(self) -> str:
        c, p = self.cfg, self.plan
        model = (
            f"ViT dim={c.dim} depth={c.depth} heads={c.heads} mlp={c.mlp_dim} tokens={c.num_tokens}"
        )
        plan = f"mesh {format_mesh(p.mesh)} sp={p.sp} zero={p.zero} remat={p.remat}"
        if p.pp != "none":
            plan += f" pp={p.pp} microbatches={p.microbatches} virtual={p.virtual} (the last stage)"
        elif p.microbatches > 1:
            plan += f" microbatches={p.microbatches} (accumulated)"
        return f"{model}, batch {self.batch}, {c.dtype}; {plan}"

    def describe(self) -> dict[str, Any]:
        p = self.plan
        return {
            "mesh": format_mesh(p.mesh),
            "sp": p.sp,
            "fsdp": p.fsdp,
            "zero": p.zero,
            "remat": p.remat,
            "grad_sync": p.grad_sync,
            "pp": p.pp,
            "microbatches": p.microbatches,
            "virtual": p.virtual,
            "batch": self.batch,
        }


def expected(
    cfg: vit_ref.ViTConfig,
    plan: Plan,
    batch: int,
    *,
    platform: str = "cpu",
    clip: bool = False,
    stage: int | None = None,
    split: TokenSplit | None = None,
    tiles: Tiles | None = None,
) -> ViTExpectation:
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
      split: the token split of a model built on (cfg, plan) (``ShardedViT.layout.split``): its plan
        was checked when it was built, so only the batch is checked here.
      tiles: the model's FSDP / ZeRO bucket tiles (``ShardedViT.layout.fsdp_tiles``); without
        a model, ``platform="tpu"`` prices the fewest rows (``parallel.tiles``).

    Returns:
      An :class:`Expectation` whose ``summary()`` is what ``Ledger.summary()`` must equal.
    """
    g = geometry(cfg, plan, batch, platform, split, tiles)
    if plan.pp == "none":
        per_micro = _per_micro_batch([*_layer_terms(g), *_pool_terms(g)], plan.microbatches)
        body = [*per_micro, *pc.fsdp_terms(g), *pc.zero_terms(g)]
    else:
        last = plan.size("stage") - 1
        body = _pipeline_terms(g, last if stage is None else stage)
    terms = [
        *body,
        *pc.gradient_terms(g),
        *_loss_terms(g),
        *(pc.grad_norm_terms(g) if clip else []),
    ]
    sizes = tuple((a, g.sizes[a]) for a in g.mesh_axes)
    return ViTExpectation(tuple(terms), cfg, plan, batch, sizes)


def _per_micro_batch(terms: list[Term], micro: int) -> list[Term]:
    """The activation terms under gradient accumulation (``microbatches`` without a
    pipeline): each runs once per micro-batch on 1/M of the batch, so M times as many ops
    move the same bytes (every one of them is linear in the batch)."""
    return [dataclasses.replace(t, count=t.count * micro) for t in terms]


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
    bytes as l/S layers at b). zb splits each backward into B and W (``pipeline.split``):
    every collective of the backward runs once, in B when the input gradient needs it (all of
    them here: each feeds the cotangent chain), so its terms are 1F1B's. A ring over seq
    runs the uniform form (``schedules.uniform``): every device runs each phase some stage
    runs, so its forward terms count the F phases run (``pipeline.chunk_runs``), not M·V,
    and its backward terms the B phases: the masked runs send what the real ones do.
    Ends: the loss, the embedding's and the head's gradients are summed over stage once (ONE
    all-reduce; only the first and the last stage add to them); the pooled features are
    summed over the token axes wherever the loss runs (``chunk_runs``' "last": the last stage,
    once per microbatch; uniform form: every stage, once per F phase that has a loss).
    FSDP: each device gathers its layers and the outer leaves once per step, before the
    schedule, and reduce-scatters their gradients once after it: one AG and one RS per bucket.
    """
    plan, micro = g.plan, g.plan.microbatches
    stages = plan.size("stage")
    depth = g.cfg.depth // stages * micro
    gm = dataclasses.replace(g, cfg=dataclasses.replace(g.cfg, depth=depth), batch=g.batch // micro)
    sched = schedule(g.cfg, plan)
    runs = pipeline.chunk_runs(sched, stage)
    per_phase = {"forward": runs["F"], "backward": runs["B"], "recompute": runs["B"]}
    layers = [_times(t, per_phase[t.phase], micro * plan.virtual) for t in _layer_terms(gm)]
    act = gm.b * g.t * g.cfg.dim * WORD
    outer = [leaf for leaf in pc.param_leaves(g) if not leaf.in_blocks]
    n_data = plan.size("data")
    ends = sum(leaf.local * (n_data if "data" in leaf.split else 1) for leaf in outer) + 1
    pool = [_times(t, runs["last"], 1) for t in _pool_terms(gm)]
    return [
        *layers,
        *_stage_permutes(g, pipeline.tables(sched), act),
        *term(
            g, "all-reduce", ["stage"], 1, all_reduce_bytes(ends * WORD, stages),
            "loss, embedding and head gradients from the first and last stage", STEP_END,
        ),
        *(t for t in pool if t.count),
        *pc.pipeline_fsdp_terms(g),
        *pc.zero_terms(g),
    ]  # fmt: skip


def _stage_permutes(g: Geometry, tab: pipeline.Tables, act: float) -> list[Term]:
    """The activation (+1) and cotangent (−1) permutes over stage (``Tables.sent_by_permute``);
    where a kind travels over several permutations (ZBV above S = 2: down its V and up it),
    one term per permutation, its pattern that permutation's device pairs."""
    out = []
    by_permute = tab.sent_by_permute()
    for kind, pairs, step, what, phase in (
        ("x", tab.x_pairs, 1, "activation to the next stage", "forward"),
        ("dy", tab.dy_pairs, -1, "cotangent to the previous stage", "backward"),
    ):
        for k, count in enumerate(by_permute[kind]):
            terms = term(g, "collective-permute", ["stage"], count, act, what, phase, step=step)
            if len(pairs) > 1:
                terms = [dataclasses.replace(t, pattern=_pairs_pattern(g, pairs[k])) for t in terms]
            out += terms
    return out


def _pairs_pattern(g: Geometry, stage_pairs: tuple[tuple[int, int], ...]) -> str:
    """The ledger's pattern of a permute over stage with ``stage_pairs`` (source stage ->
    target stage), on every device of the mesh (the other coordinates kept)."""
    sizes = tuple(g.sizes[a] for a in g.mesh_axes)
    at = g.mesh_axes.index("stage")
    target = dict(stage_pairs)
    pairs = tuple(
        (int(np.ravel_multi_index(c, sizes)),
         int(np.ravel_multi_index((*c[:at], target[c[at]], *c[at + 1 :]), sizes)))
        for c in np.ndindex(*sizes) if c[at] in target
    )  # fmt: skip
    return pattern_of((), pairs, ("stage",), AbstractMesh(sizes, tuple(g.mesh_axes)))


def _times(t: Term, runs: int, per: int) -> Term:
    """``t`` (a term of ``per`` runs) as ``runs`` runs make it."""
    assert t.count % per == 0, (t, per)
    return dataclasses.replace(t, count=t.count // per * runs, bytes_sent=t.bytes_sent * runs / per)


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
    Under remat "dots" the re-run g and the MLP's backward f of the same layer are
    independent, and XLA's all-reduce combiner runs them as ONE op: the bytes as above, no
    extra op.
    """
    n = g.plan.size("model")
    if n == 1 or g.plan.sp == "megatron":
        return []
    layers, a = g.cfg.depth, g.b * g.t * g.cfg.dim
    if g.plan.halves:
        return _halves_terms(g, layers, a // 2)
    ar = functools.partial(term, g, "all-reduce", ["model"])
    terms = [
        *ar(2 * layers, all_reduce_bytes(a * g.act, n), "Megatron g: sum {U_model}", "forward"),
        *ar(2 * layers, all_reduce_bytes(a * WORD, n), "Megatron f: sum cotangent", "backward"),
        *ar(layers * g.plan.recompute, all_reduce_bytes(a * g.act, n), "attention g", "recompute"),
    ]
    if g.plan.remat == "dots":  # the re-run g and the MLP's f of its layer: one combined op
        terms[-1] = dataclasses.replace(terms[-1], count=0, phase="recompute (combined)")
    return terms


def _halves_terms(g: Geometry, layers: int, half: int) -> list[Term]:
    """Plain TP with ``overlap`` (Domino's two half-batches, ``tensor.pipelined_regions``):
    each region's all-reduce runs once per half, forward (Megatron g, in the compute dtype)
    and backward (f, the float32 cotangent), each an ``overlap.all_reduce_permuted`` of the
    half's activation (``pc.permuted_all_reduce_terms``): 2(n−1)/n · the padded half each,
    plain TP's bytes when nothing pads (half = A/2 elements).
      forward  2·l regions × 2 halves × (RS_perm + AG);   backward the same"""
    runs, terms = 2 * layers * 2, []
    for word, phase, what in ((g.act, "forward", "Megatron g"), (WORD, "backward", "Megatron f")):
        terms += pc.permuted_all_reduce_terms(
            g, ("model",), runs, half, word, f"{what} per half-batch",
            "beside the other half's matmuls", phase,
        )  # fmt: skip
    return terms


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
    if g.plan.overlap:
        return _overlapped_sp_terms(g, n, layers, full)
    ag = functools.partial(term, g, "all-gather", ["model"])
    rs = functools.partial(term, g, "reduce-scatter", ["model"])
    gather, scatter = all_gather_bytes(full * WORD, n), reduce_scatter_bytes(full * g.act, n)
    back_ag, back_rs = all_gather_bytes(full * g.act, n), reduce_scatter_bytes(full * WORD, n)
    remat = g.plan.recompute
    return [
        *ag(2 * layers, gather, "gather token shards into each TP region", "forward"),
        *rs(2 * layers, scatter, "sum {U_model}, keep own tokens", "forward"),
        *ag(2 * layers, back_ag, "transpose of the exit reduce-scatter", "backward"),
        *rs(2 * layers, back_rs, "transpose of the entry all-gather", "backward"),
        *ag(2 * layers * remat, gather, "re-gather both regions' inputs", "recompute"),
        *rs(layers * remat, scatter, "attention exit (LN2 reads it)", "recompute"),
    ]


def _overlapped_sp_terms(g: Geometry, n: int, layers: int, full: int) -> list[Term]:
    """Megatron-SP with ``overlap``: each region's entry is an ``ag_matmul`` and its exit a
    ``matmul_rs``, rings of n − 1 permutes (i -> i + 1) of one token block A'/n in the compute
    dtype; backward, each ring's transpose is again a ring (dx's partial sums, dy's blocks).
      forward  2·l regions × 2 rings × (n−1) × A'/n·a;   backward the same
    ``"bidirectional"``: every ring is two, i -> i + 1 and i -> i − 1, of half a block each:
    the same bytes in twice the permutes (on a ring of 2 both are the one shift).
    (the plain entry gathers the float32 LayerNorm output: with a bf16 compute dtype the
    overlapped forward entry and backward exit-transpose send half its bytes)."""
    ways = (1, -1) if g.plan.overlap == "bidirectional" else (1,)
    block = permute_bytes(full // n * g.act) / len(ways)
    rings = 4 * layers * (n - 1)
    out = []
    for way in ways:
        hop = functools.partial(term, g, "collective-permute", ["model"], step=way)
        out += [
            *hop(rings, block, "token blocks round the model ring under each region's matmuls",
                 "forward"),
            *hop(rings, block, "the rings' transposes: dx's partial sums, dy's blocks",
                 "backward"),
        ]  # fmt: skip
    return out


def _ring_terms(g: Geometry) -> list[Term]:
    """Ring attention over R (seq, or seq_ring in USP) of size r; blocks of E = b·t·h_X·k.

    ``q[b, T_R, h, k] · k, v[b, S_R, h, k]``: each device keeps its queries while the K and V
    blocks visit every device: r−1 hops each (a device already holds its own block), the
    fewest that bring every key to every query without an all-gather. Backward (hand-written,
    saving only q, k, v, out, lse) sends K, V round again (r−1 hops each) with float32 dK, dV
    accumulators that need r hops to return to their owner, the last in K's dtype (the sums
    are complete: the cast that follows moves before the permute).
      forward  2·l·(r−1) × E·w;   backward 2·l·(r−1) × E·w + 2·l·(r−1) × E·4 + 2·l × E·w
    In USP the ring runs on h_X/u heads of u·t tokens: the same E.
    remat: the re-run forward sends K and V round again, 2·l·(r−1) hops; when r = 2 its one
    hop is the backward's first hop exactly (both loops have one trip and vanish), and XLA
    merges the two (0 extra). Likewise with r = 2 (no remat) and no layer loop (l = 1, or the
    layers unrolled) nothing is left between the forward's hop and the backward's identical
    one: merged, 0 backward K/V hops.
    """
    if g.ring_axis is None:
        return []
    r, layers, e = g.sizes[g.ring_axis], g.cfg.depth, g.block
    # Every hop (K, V and the dK, dV accumulators) goes from ring position i to i + 1.
    hop = functools.partial(term, g, "collective-permute", [g.ring_axis], step=1)
    redo = 2 * layers * (r - 1) if g.plan.recompute and r > 2 else 0
    merged = unlooped_layers(g.cfg, g.plan) if r == 2 and not g.plan.recompute else 0
    again = 2 * (layers - merged) * (r - 1)
    return [
        *hop(
            2 * layers * (r - 1), permute_bytes(e * g.act), "K, V blocks round the ring", "forward"
        ),
        *hop(again, permute_bytes(e * g.act), "K, V round again", "backward"),
        *hop(2 * layers * (r - 1), permute_bytes(e * WORD), "dK, dV accumulators", "backward"),
        *hop(2 * layers, permute_bytes(e * g.act), "dK, dV home, in K's dtype", "backward"),
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
    a2a = functools.partial(term, g, "all-to-all", [g.ulysses_axis])
    return [
        *a2a(4 * layers, each, "q, k, v to a head split; out back", "forward"),
        *a2a(4 * layers, each, "transposed all-to-alls", "backward"),
        *a2a(
            4 * layers * g.plan.recompute, each, "q, k, v, out of the re-run forward", "recompute"
        ),
    ]


def _pool_terms(g: Geometry) -> list[Term]:
    """Pooling over split tokens: one AllReduce over the token axes of pooled[b, d].

    ``tok``: only the shard holding token 0 has the class token; ``gap``: each shard holds a
    partial sum of the valid tokens. Either way ``pooled[b, d]{U_S}`` -> psum: b·d·w, once.
    Its transpose (an invariant cotangent cast to varying) moves nothing.
    """
    return term(
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
    terms = term(
        g,
        "all-reduce",
        ["data"],
        1,
        all_reduce_bytes(WORD, g.plan.size("data")),
        "loss value",
        STEP_END,
    )
    return [dataclasses.replace(t, fused=STEP_END) for t in terms]
