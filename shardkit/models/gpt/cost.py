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
  data, expert, seq   the gradients (the experts' own over data × seq only) and the loss, one
              op each; the gradient norm over every axis
  FSDP        every leaf has an embed dim, so every leaf is split over data: one all-gather
              over data per bucket forward, its reduce-scatter backward, (n−1)/n · the
              gathered bytes each (two buckets with TP: the leaves varying over model and the
              rest); the reduce-scatter sums over data, so the gradients' all-reduce spans
              expert × seq only (the experts': seq only) and the loss goes alone, or with the
              gradient norm when its axes are every axis (one op of 2·w)

The Ulysses core and remat have no terms here (``expected`` returns None for them: under
remat the blocks' collectives re-run in the backward).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from shardkit.comm import contract
from shardkit.comm.terms import Expectation, Term
from shardkit.models.gpt.model import GPTConfig, GPTPlan
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
        return (f"GPT ({kind}, dim {self.cfg.dim}, {self.cfg.layers} layers), batch "
                f"{self.batch} × {self.cfg.tokens} tokens on {self.plan.name}")  # fmt: skip

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.plan.mesh)

    def describe(self) -> dict[str, Any]:
        return {"model": "gpt" if self.cfg.experts is None else "moe-gpt",
                "mesh": self.plan.mesh, "layout": self.plan.layout, "core": self.plan.core,
                "fsdp": self.plan.fsdp, "batch": self.batch}  # fmt: skip


def expectation(
    cfg: GPTConfig, plan: GPTPlan, batch: int, local_params: int
) -> GPTExpectation | None:
    """``expected`` as the ``Expectation`` a ``comm.report.Report`` compares with."""
    terms = expected(cfg, plan, batch, local_params)
    return None if terms is None else GPTExpectation(tuple(terms), cfg, plan, batch)


def expected(cfg: GPTConfig, plan: GPTPlan, batch: int, local_params: int) -> list[Term] | None:
    """The collectives of one train step clipped by its global norm (None: the Ulysses core,
    or remat); ``local_params``: the elements of params one device holds."""
    mesh = plan.mesh
    if (plan.core != "ring" and mesh["seq"] > 1) or plan.remat != "none":
        return None
    n_data, n_ep, n_seq, n_model = (mesh[a] for a in ("data", "expert", "seq", "model"))
    b, t, layers = batch // (n_data * n_ep), cfg.tokens // n_seq, cfg.layers
    fsdp = plan.fsdp and n_data > 1
    out = [] if cfg.experts is None else moe_terms(cfg, cfg.experts, mesh, b * t, fsdp)
    if n_model > 1:
        out += _tp_terms(cfg, n_model, b * t)
    if n_seq > 1:  # K, V: n−1 hops forward and again backward; dK, dV: n hops home
        local_kv = max(cfg.kv_heads // n_model, 1)  # kv_repeat: one head per device
        kv = b * t * local_kv * (cfg.dim // cfg.heads) * W
        hops = 2 * layers * (n_seq - 1) * 2 + 2 * layers * n_seq
        out.append(contract.permute("seq", kv, hops, "K, V, dK, dV blocks of h_kv heads"))
    experts = 0 if cfg.experts is None else expert_params(cfg, cfg.experts, mesh)
    if fsdp:
        return out + _fsdp_terms(mesh, local_params, local_params - experts // n_data)
    sync = _axes(mesh, ("data", "expert", "seq"))
    if sync:  # every gradient bucket and the loss, combined into one op at the step's end
        size = (local_params - experts + 1) * W
        out.append(contract.all_reduce(sync, size, n_data * n_ep * n_seq, 1, "gradients + loss"))
    every = _axes(mesh, ("data", "expert", "seq", "model"))
    out.append(contract.all_reduce(every, W, math.prod(mesh.values()), 1, "gradient norm"))
    return out


def _fsdp_terms(mesh: dict[str, int], local_params: int, dense_local: int) -> list[Term]:
    """FSDP over data: the buckets' all-gathers and reduce-scatters, the rest of the gradient
    sync (``dense_local``: one device's elements of the non-expert leaves), the loss, the
    gradient norm."""
    n_data = mesh["data"]
    buckets = 2 if mesh["model"] > 1 else 1  # varying over model, or not
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
    """Elements of one device's expert weights (gate, up, down of its E/X experts)."""
    local = experts.experts // mesh["expert"]
    return 3 * cfg.layers * local * cfg.dim * cfg.mlp // mesh["model"]


def moe_terms(
    cfg: GPTConfig, experts: MoE, mesh: dict[str, int], tokens: int, fsdp: bool = False
) -> list[Term]:
    """A MoE block's collectives: per layer, dispatch and combine all-to-alls over expert
    (forward and backward) of the local buffer [E, C, d], the counts' all-reduce; inside each
    expert, TP's g and f on [E/X, X·C, d] (the same bytes); the experts' gradients synced over
    data and seq, never over expert."""
    n_ep, n_model, layers = mesh["expert"], mesh["model"], cfg.layers
    buffers = experts.experts * experts.capacity(tokens) * cfg.dim * W
    groups = _axes(mesh, ("data", "expert", "seq"))
    n_groups = math.prod(mesh[a] for a in groups)
    out = [contract.all_to_all("expert", buffers, n_ep, 4 * layers, "dispatch, combine ×2"),
           contract.all_reduce(groups, (experts.experts + 1) * W, n_groups, layers,
                               "tokens per expert, dropped")]  # fmt: skip
    if n_model > 1:
        out.append(contract.all_reduce("model", buffers, n_model, 2 * layers, "experts' g, f"))
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
