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

The Ulysses core has no terms here (``expected`` returns None for it).
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
    """The collectives of one train step clipped by its global norm (None: Ulysses core);
    ``local_params``: the elements of params one device holds."""
    mesh = plan.mesh
    if plan.core != "ring" and mesh["seq"] > 1:
        return None
    n_data, n_ep, n_seq, n_model = (mesh[a] for a in ("data", "expert", "seq", "model"))
    b, t, layers = batch // (n_data * n_ep), cfg.tokens // n_seq, cfg.layers
    out = [] if cfg.experts is None else moe_terms(cfg, cfg.experts, mesh, b * t)
    if n_model > 1:
        out += _tp_terms(cfg, n_model, b * t)
    if n_seq > 1:  # K, V: n−1 hops forward and again backward; dK, dV: n hops home
        local_kv = max(cfg.kv_heads // n_model, 1)  # kv_repeat: one head per device
        kv = b * t * local_kv * (cfg.dim // cfg.heads) * W
        hops = 2 * layers * (n_seq - 1) * 2 + 2 * layers * n_seq
        out.append(contract.permute("seq", kv, hops, "K, V, dK, dV blocks of h_kv heads"))
    sync = _axes(mesh, ("data", "expert", "seq"))
    if sync:  # every gradient bucket and the loss, combined into one op at the step's end
        experts = 0 if cfg.experts is None else expert_params(cfg, cfg.experts, mesh)
        size = (local_params - experts + 1) * W
        out.append(contract.all_reduce(sync, size, n_data * n_ep * n_seq, 1, "gradients + loss"))
    every = _axes(mesh, ("data", "expert", "seq", "model"))
    out.append(contract.all_reduce(every, W, math.prod(mesh.values()), 1, "gradient norm"))
    return out


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


def moe_terms(cfg: GPTConfig, experts: MoE, mesh: dict[str, int], tokens: int) -> list[Term]:
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
    sync = _axes(mesh, ("data", "seq"))
    if sync:
        size = expert_params(cfg, experts, mesh) * W
        n = math.prod(mesh[a] for a in sync)
        out.append(contract.all_reduce(sync, size, n, 1, "expert gradients (not over expert)"))
    return out


def _axes(mesh: dict[str, int], names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in names if mesh[a] > 1)
