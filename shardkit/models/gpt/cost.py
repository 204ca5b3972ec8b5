"""The GPT's clipped train step on paper: every collective per device, from the ring formulas.

Per step, with b·t local tokens of width D (w = 4 bytes, float32), L layers:

  model (TP)  Megatron g forward and f backward per region (attention; the dense MLP), the
              vocabulary embedding's g and the head's f: (2 · regions · L + 2) all-reduces of
              b·t·D·w; the vocab-parallel cross-entropy's max and (Σ exp, target logit):
              2 all-reduces of b·t·w and 2·b·t·w; with kv_repeat the K, V weight gradients
              ride in a block's own op (bytes, no op of their own)
  seq (ring)  K, V: n−1 hops forward and again backward, dK, dV: n hops home, per layer:
              blocks of b·t·h_kv_local·k·w
  expert      per MoE layer: 4 all-to-alls of the dispatch buffer [E, C, D]; an all-reduce of
              E + 1 counts over data × expert × seq; with TP, g and f on [E/X, X·C, D]
              (under a pipeline: per layer of each F and B phase run, at a microbatch's
              capacity; the counts forward only)
  data, expert, seq   the gradients (the experts' own over data × seq only) and the loss, one
              op each; the gradient norm over every axis
  FSDP        every leaf has an embed dim, so every leaf is split over data: one all-gather
              over data per bucket forward, its reduce-scatter backward, (n−1)/n · the
              gathered bytes each (two buckets with TP: the leaves varying over model and the
              rest; twice as many under a pipeline: the stage's layers and the ends); the
              reduce-scatter sums over data, so the gradients' all-reduce spans expert × seq
              only (the experts': seq only) and the loss goes alone, or with the gradient norm
              when its axes are every axis (one op of 2·w)

  stage (pp)  per device of stage s, with M microbatches of b/M: one collective-permute of a
              microbatch activation (b/M)·t·D·w per tick sending it on and per tick sending its
              cotangent back (``pipeline.Tables.sent``); the layer terms of M·L/S layers at b/M
              (the bytes of L/S layers at b); the embedding's g on stage 0 only and the head's
              f with the cross-entropy's reductions on the last stage only, once per
              microbatch; ONE all-reduce over stage of the embedding's, the norm's and the
              head's gradients and the loss (tied: the embedding's gradient, its lookup's
              on stage 0 plus the head's on the last, is that op's sum, no op of its own;
              MoE: the E + 1 routing counts summed over the stages' layers too);
              the gradient norm over every axis, stage too.
              A ring over seq runs the uniform form (``schedules.uniform``): every device
              runs each phase some stage runs, so the layer and ring terms count the F and B
              phases run (``pipeline.chunk_runs``) and the ends' terms every phase that
              needs them, on every stage

  documents   the global count of real targets: one all-reduce of w over data × expert × seq

The Ulysses core, remat, and packed documents under a ring over seq have no terms here
(``expected`` returns None for them: under remat the blocks' collectives re-run in the
backward; the ring carries each query block's segment ids too, hops that XLA hoists out of
the layer loop and merges between forward and backward as it sees fit: at n = 2, one hop per
step; at n = 4, nine; under a pipeline, n − 1 per chunk run, F and B).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from shardkit.comm import contract
from shardkit.comm.terms import Expectation, Term
from shardkit.models.gpt.model import GPTConfig, GPTPlan
from shardkit.parallel import pipeline
from shardkit.parallel.moe import MoE

W = 4  # float32 bytes


@dataclasses.dataclass(frozen=True)
class GPTExpectation(Expectation):
    """The expected collectives of one clipped GPT train step for (cfg, plan, batch)."""

    cfg: GPTConfig
    plan: GPTPlan
    batch: int

    @property
    def title(self) -> str:
        kind = "dense" if self.cfg.experts is None else f"{self.cfg.experts.experts} experts"
        kind += ", tied" if self.cfg.tied else ""
        return (f"GPT ({kind}, dim {self.cfg.dim}, {self.cfg.layers} layers), batch "
                f"{self.batch} × {self.cfg.tokens} tokens on {self.plan.name}")  # fmt: skip

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.plan.mesh)

    def describe(self) -> dict[str, Any]:
        return {"model": "gpt" if self.cfg.experts is None else "moe-gpt",
                "mesh": self.plan.mesh, "layout": self.plan.layout, "core": self.plan.core,
                "fsdp": self.plan.fsdp, "tied": self.cfg.tied, "batch": self.batch}  # fmt: skip


def expectation(
    cfg: GPTConfig, plan: GPTPlan, batch: int, local_params: int, stage: int | None = None
) -> GPTExpectation | None:
    """``expected`` as the ``Expectation`` a ``comm.report.Report`` compares with."""
    terms = expected(cfg, plan, batch, local_params, stage)
    return None if terms is None else GPTExpectation(tuple(terms), cfg, plan, batch)


def expected(
    cfg: GPTConfig, plan: GPTPlan, batch: int, local_params: int, stage: int | None = None
) -> list[Term] | None:
    """The collectives of one train step clipped by its global norm (None: the Ulysses core,
    remat, or packed documents under a ring); ``local_params``: the elements of params one
    device holds; ``stage``: under a pipeline, the stage whose device is expected (default:
    the last)."""
    if no_terms_reason(cfg, plan):
        return None
    mesh = plan.mesh
    n_data, n_ep, n_seq, n_model = (mesh[a] for a in ("data", "expert", "seq", "model"))
    b, t = batch // (n_data * n_ep), cfg.tokens // n_seq
    fsdp = plan.fsdp and n_data > 1
    at = mesh["stage"] - 1 if stage is None else stage
    forward, backward = _layer_runs(cfg, plan, at)
    tokens = b * t // plan.microbatches  # a microbatch's under a pipeline
    out = []
    if cfg.experts is not None:
        out += moe_terms(cfg, cfg.experts, mesh, tokens, fsdp, (forward, backward))
    counted = _axes(mesh, ("data", "expert", "seq"))
    if cfg.documents and counted:
        n = math.prod(mesh[a] for a in counted)
        out.append(contract.all_reduce(counted, W, n, 1, "real targets' count"))
    if plan.pp != "none":
        out += _pipeline_terms(cfg, plan, b * t, at, forward + backward)
    elif n_model > 1:
        out += _tp_terms(cfg, n_model, b * t)
    if n_seq > 1:  # K, V: n−1 hops forward and again backward; dK, dV: n hops home
        local_kv = max(cfg.kv_heads // n_model, 1)  # kv_repeat: one head per device
        kv = tokens * local_kv * (cfg.dim // cfg.heads) * W
        hops = 2 * forward * (n_seq - 1) + 2 * backward * (2 * n_seq - 1)
        out.append(contract.permute("seq", kv, hops, "K, V, dK, dV blocks of h_kv heads"))
    experts = 0 if cfg.experts is None else expert_params(cfg, cfg.experts, mesh)
    if fsdp:
        return out + _fsdp_terms(mesh, local_params, local_params - experts // n_data)
    sync = _axes(mesh, ("data", "expert", "seq"))
    if sync:  # every gradient bucket and the loss, combined into one op at the step's end
        size = (local_params - experts + 1) * W
        out.append(contract.all_reduce(sync, size, n_data * n_ep * n_seq, 1, "gradients + loss"))
    every = _axes(mesh, ("data", "stage", "expert", "seq", "model"))
    out.append(contract.all_reduce(every, W, math.prod(mesh.values()), 1, "gradient norm"))
    return out


def no_terms_reason(cfg: GPTConfig, plan: GPTPlan) -> str:
    """Why ``expected`` has no terms for this plan ("" when it has)."""
    ring = plan.mesh["seq"] > 1 and plan.core == "ring"
    return (
        "remat (the blocks' collectives re-run)" if plan.remat != "none"
        else "the Ulysses core" if plan.mesh["seq"] > 1 and not ring
        else "packed documents under a ring (the segment ids' hops are XLA's choice)"
        if ring and cfg.documents
        else ""
    )  # fmt: skip


def _layer_runs(cfg: GPTConfig, plan: GPTPlan, stage: int) -> tuple[int, int]:
    """(forward, backward) layer runs on a device: every layer once each, or under a
    pipeline its chunk's layers per F and B phase that ``stage`` runs (``chunk_runs``)."""
    if plan.pp == "none":
        return cfg.layers, cfg.layers
    runs = pipeline.chunk_runs(plan.schedule(), stage)
    per_chunk = cfg.layers // (plan.mesh["stage"] * plan.virtual)
    return per_chunk * runs["F"], per_chunk * runs["B"]


def _pipeline_terms(
    cfg: GPTConfig, plan: GPTPlan, tokens: int, stage: int, layer_runs: int
) -> list[Term]:
    """One stage's device under the pipeline (module docstring): the activation and cotangent
    permutes, its layers' TP terms (``layer_runs``: its F and B layer runs, ``_layer_runs``),
    the ends' TP terms where they run, and the ends' gradients and loss summed over stage."""
    mesh, micro = plan.mesh, plan.microbatches
    stages, n_model, vocab = mesh["stage"], mesh["model"], cfg.vocab // mesh["model"]
    act = tokens // micro * cfg.dim * W
    sent_x, sent_dy = pipeline.tables(plan.schedule()).sent()
    # embed, head (none when tied), norm (gathered if FSDP), the loss; MoE: the routing counts
    counts = 0 if cfg.experts is None else cfg.experts.experts + 1
    ends = (1 if cfg.tied else 2) * vocab * cfg.dim + cfg.dim + 1 + counts
    out = [
        contract.permute("stage", act, sent_x + sent_dy, "activations on, cotangents back",
                         n=stages),
        contract.all_reduce("stage", ends * W, stages, 1,
                            "embedding, norm, head grads + loss (+ routing counts)"),
    ]  # fmt: skip
    if n_model == 1:
        return out
    runs = pipeline.chunk_runs(plan.schedule(), stage)  # M·V each; uniform form: more
    regions = 2 if cfg.experts is None else 1  # a MoE block's MLP region is in moe_terms
    layers = regions * layer_runs  # Megatron f, g per region per layer run
    out.append(
        contract.all_reduce(
            "model",
            act,
            n_model,
            layers + runs["first"] + runs["last"],
            "Megatron f, g; where the embedding runs its g, where the head runs its f",
        )
    )
    if runs["last"]:
        per_token = tokens // micro * W
        out += [
            contract.all_reduce("model", per_token, n_model, runs["last"], "cross-entropy max"),
            contract.all_reduce("model", 2 * per_token, n_model, runs["last"], "Σ exp, target"),
        ]
    return out


def _fsdp_terms(mesh: dict[str, int], local_params: int, dense_local: int) -> list[Term]:
    """FSDP over data: the buckets' all-gathers and reduce-scatters, the rest of the gradient
    sync (``dense_local``: one device's elements of the non-expert leaves), the loss, the
    gradient norm."""
    n_data = mesh["data"]
    # one bucket per varying type: over model or not; under a pipeline, over stage (the
    # layers) or not (the ends)
    buckets = (2 if mesh["model"] > 1 else 1) * (2 if mesh["stage"] > 1 else 1)
    gathered = local_params * n_data * W / buckets
    out = [
        contract.all_gather("data", gathered, n_data, buckets, "params, per bucket"),
        contract.reduce_scatter("data", gathered, n_data, buckets, "their gradients"),
    ]
    rest = _axes(mesh, ("expert", "seq"))
    if rest:
        n = math.prod(mesh[a] for a in rest)
        out.append(contract.all_reduce(rest, dense_local * W, n, 1, "gradients (not experts')"))
    loss, every = _axes(mesh, ("data", "expert", "seq")), _axes(mesh, tuple(mesh))
    n_loss, n_all = math.prod(mesh[a] for a in loss), math.prod(mesh.values())
    if loss == every:  # the same group: XLA combines the two scalars
        return [*out, contract.all_reduce(every, 2 * W, n_all, 1, "loss + gradient norm")]
    return [*out, contract.all_reduce(loss, W, n_loss, 1, "loss"),
            contract.all_reduce(every, W, n_all, 1, "gradient norm")]  # fmt: skip


def _tp_terms(cfg: GPTConfig, n_model: int, tokens: int) -> list[Term]:
    acts, per_token = tokens * cfg.dim * W, tokens * W
    regions = 2 if cfg.experts is None else 1  # a MoE block's MLP region is in moe_terms
    out = [
        contract.all_reduce("model", acts, n_model, 2 * regions * cfg.layers + 2,
                            "Megatron f, g; the vocab embedding's g, the head's f"),
        contract.all_reduce("model", per_token, n_model, 1, "cross-entropy max (pmax)"),
        contract.all_reduce("model", 2 * per_token, n_model, 1,
                            "Σ exp and the target logit (one combined op)"),
    ]  # fmt: skip
    if n_model > cfg.kv_heads:  # kv_repeat: whole K / V weights, gradients summed
        kv = 2 * cfg.dim * cfg.kv_heads * (cfg.dim // cfg.heads) * W
        term = contract.all_reduce("model", kv, n_model, cfg.layers, "K, V weight gradients")
        out.append(dataclasses.replace(term, count=0))  # combined into a block's own op
    return out


def expert_params(cfg: GPTConfig, experts: MoE, mesh: dict[str, int]) -> int:
    """Elements of one device's expert weights (gate, up, down of its E/X experts, in its
    stage's layers)."""
    local = experts.experts // mesh["expert"]
    return 3 * cfg.layers // mesh["stage"] * local * cfg.dim * cfg.mlp // mesh["model"]


def moe_terms(
    cfg: GPTConfig,
    experts: MoE,
    mesh: dict[str, int],
    tokens: int,
    fsdp: bool = False,
    runs: tuple[int, int] | None = None,
) -> list[Term]:
    """A MoE block's collectives: per layer, dispatch and combine all-to-alls over expert
    (forward and backward) of the local buffer [E, C, d], the counts' all-reduce (forward);
    inside each expert, TP's g and f on [E/X, X·C, d] (the same bytes); the experts' gradients
    synced over data and seq, never over expert. ``runs``: (forward, backward) layer runs
    (default: each layer once; under a pipeline ``tokens`` are a microbatch's)."""
    n_ep, n_model = mesh["expert"], mesh["model"]
    forward, backward = runs or (cfg.layers, cfg.layers)
    buffers = experts.experts * experts.capacity(tokens) * cfg.dim * W
    groups = _axes(mesh, ("data", "expert", "seq"))
    n_groups = math.prod(mesh[a] for a in groups)
    out = [contract.all_to_all("expert", buffers, n_ep, 2 * (forward + backward),
                               "dispatch, combine ×2"),
           contract.all_reduce(groups, (experts.experts + 1) * W, n_groups, forward,
                               "tokens per expert, dropped")]  # fmt: skip
    if n_model > 1:
        out.append(contract.all_reduce("model", buffers, n_model, forward + backward,
                                       "experts' g, f"))  # fmt: skip
    sync = _axes(mesh, ("seq",) if fsdp else ("data", "seq"))  # FSDP: data by reduce-scatter
    if sync:
        size = expert_params(cfg, experts, mesh) * W // (mesh["data"] if fsdp else 1)
        n = math.prod(mesh[a] for a in sync)
        out.append(contract.all_reduce(sync, size, n, 1, "expert gradients (not over expert)"))
    return out


def model_flops(cfg: GPTConfig, batch: int) -> float:
    """FLOPs of one train step on paper: 6 × the multiply-adds each token meets (q, k, v, out;
    the SwiGLU, or the router and its top-k experts' SwiGLUs; the head; the embedding is a
    lookup) × the tokens, plus causal attention's q·kᵀ and p·v (half of t² each): 6·B·t²·D·L.
    Norms, softmax and the optimizer are left out, as MFU conventionally does."""
    d, kv = cfg.dim, cfg.kv_heads * (cfg.dim // cfg.heads)
    mlp = 3 * d * cfg.mlp
    if cfg.experts is not None:
        mlp = cfg.experts.top_k * mlp + d * cfg.experts.experts
    per_token = cfg.layers * (2 * d * d + 2 * d * kv + mlp) + d * cfg.vocab
    tokens = batch * cfg.tokens
    return 6.0 * per_token * tokens + 6.0 * tokens * cfg.tokens * d * cfg.layers


def _axes(mesh: dict[str, int], names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in names if mesh[a] > 1)
