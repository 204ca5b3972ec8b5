"""Mixture of experts for ``shard_map`` bodies: a top-k router, capacity dispatch and combine,
the grouped expert FFN, the balancing losses, and expert parallelism over a mesh axis X.

A *group* is the tokens one device routes together: its local tokens x[b, t, d] (every axis
that splits tokens — data, expert, seq — makes more groups; ``model`` does not: its devices
hold the same tokens and route them identically). Each group gives every expert C slots:

  route        x[n, d] · router[d, E] -> logits[n, E] -> scores -> top-k:
               experts[n, k] (ids), weights[n, k] (combine weights), probs[n, E]
  assign_slots experts[n, k] -> slot position[n, k] in its expert's buffer, kept[n, k]
  dispatch     x[n, d] -> buffers[E, C, d] (kept assignments only; empty slots are 0)
  expert_ffn   buffers[E_l, c, d] -> SwiGLU per expert, a batched matmul over local experts
               (F split over the TP axis: column-parallel gate/up, row-parallel down)
  combine      y[E, C, d] -> out[n, d] = Σ_k kept · weight · y[expert, slot]
  to_experts   EP dispatch: buffers[E, C, d] -> all_to_all over X -> [E/X, X·C, d], this
               device's experts' slots from every group of the expert axis
  from_experts the inverse all_to_all: [E/X, X·C, d] -> [E, C, d] back at each group
  ring_of_experts  the alternative EP (``dispatch_by="ring"``): tokens, weights and slots
               all-gathered over X, this device's experts run on all X groups' slots, the
               partial outputs [X, n, d] reduce-scattered back to [n, d]

The drop rule (``MoE.order``): a group's k·n assignments are ranked, and an assignment keeps a
slot if fewer than C higher-ranked ones went to its expert. ``"choice"`` (GShard, Switch):
every token's first choice in token order, then every second choice, ...; ``"score"``
(batch-prioritised routing): by descending combine weight, ties in choice order. The token
order is the group's local row-major (b, t) order. Capacity C = ceil(factor · n · k / E) per
group; ``capacity_factor=None`` is dropless: C = n, the most one group can send one expert
(its k choices are distinct).

Losses, each returned as this device's *share* (the shares summed over the token groups are
the loss, the ``ShardedModel`` convention):

  load balance  Switch/GShard: E · Σ_e f_e · P_e, f_e the fraction of the k·N assignments
                routed to e (before drops, no gradient), P_e the mean over the N tokens of
                ``probs`` (scores normalised to sum 1 per token: softmax's own, or the
                sigmoid scores divided by their sum). ``aux="sequence"`` (DeepSeek-V3's
                sequence-wise form): f and P per sequence, the losses averaged over sequences.
  router z      mean over tokens of logsumexp(logits)²  (ST-MoE).

Communication per MoE layer and device (X = the expert axis, V = E·C·d·bytes, the local
dispatch buffer): forward 2 all-to-alls of V, (X−1)/X · V sent each; backward the same two;
one all-reduce of E + 1 float32 counts over the token axes (assignments per expert and the
dropped ones; no gradient), with ``aux="sequence"`` one of [b, E] over the seq axes; with TP,
the down projection's all-reduce of the buffers over the TP axis forward (Megatron g) and
Megatron f's backward. The ring of experts instead: forward all-gathers of the tokens
(X−1)·n·d·w, of the weights (X−1)·n·k·4 and of the int32 ids and slots (X−1)·n·2k·4, a
reduce-scatter of the outputs (X−1)·n·d·w; backward an all-gather of the output cotangent and
reduce-scatters of the tokens' and weights' cotangents, the same bytes. Expert weights are
split over X and their gradients are whole there (every group's tokens came to them): they are
synced over data, never over X.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from shardkit.parallel.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    axis_index,
    axis_size,
    reduce_scatter,
)
from shardkit.parallel.tensor import enter_tp, exit_tp
from shardkit.parallel.vma import vary, vary_like

SCORES = ("softmax", "sigmoid")
DROP_ORDERS = ("choice", "score")
AUX_MODES = ("batch", "sequence")
DISPATCHES = ("all_to_all", "ring")
Params = dict[str, Array]


@dataclasses.dataclass(frozen=True)
class MoE:
    """How tokens are routed: E experts, top-k, the capacity and the drop and loss rules.

    Attributes:
      experts: E, the number of experts.
      top_k: k, the experts per token.
      capacity_factor: slots per expert and group as a multiple of the even share n·k/E;
        None for dropless (C = n).
      score: ``"softmax"`` or ``"sigmoid"`` router scores.
      normalize: divide the k chosen scores by their sum (the combine weights sum to 1).
      order: the drop order, ``"choice"`` or ``"score"`` (the module docstring).
      aux: the load-balance loss over the whole batch (``"batch"``) or per sequence.
    """

    experts: int
    top_k: int = 2
    capacity_factor: float | None = 1.25
    score: str = "softmax"
    normalize: bool = False
    order: str = "choice"
    aux: str = "batch"

    def __post_init__(self) -> None:
        checks = [
            (self.experts < 1, f"experts must be positive, got {self.experts}"),
            (not 1 <= self.top_k <= self.experts,
             f"top_k must be in 1..experts={self.experts}, got {self.top_k}"),
            (self.capacity_factor is not None and not self.capacity_factor > 0,
             f"capacity_factor must be positive (or None: dropless), got {self.capacity_factor}"),
            (self.score not in SCORES, f"score must be one of {SCORES}, got {self.score!r}"),
            (self.order not in DROP_ORDERS,
             f"order must be one of {DROP_ORDERS}, got {self.order!r}"),
            (self.aux not in AUX_MODES, f"aux must be one of {AUX_MODES}, got {self.aux!r}"),
        ]  # fmt: skip
        for failed, message in checks:
            if failed:
                raise ValueError(message + ".")

    def capacity(self, n: int) -> int:
        """C, the slots per expert for a group of ``n`` tokens."""
        if self.capacity_factor is None:
            return n
        return max(1, math.ceil(self.capacity_factor * n * self.top_k / self.experts))


class Routing(NamedTuple):
    """A group's routing: ids and combine weights of the k chosen experts, and the scores."""

    experts: Int[Array, "n k"]
    weights: Float[Array, "n k"]
    probs: Float[Array, "n e"]  # scores normalised to sum 1 per token (the aux loss's P)
    logits: Float[Array, "n e"]


class Slots(NamedTuple):
    """Where each assignment sits in its expert's buffer, and whether it kept its slot."""

    position: Int[Array, "n k"]
    kept: Bool[Array, "n k"]


class MoEAux(NamedTuple):
    """What a MoE layer reports besides its output.

    ``load_balance`` and ``router_z`` are this device's shares (summed over the token groups,
    the losses); ``tokens_per_expert`` (assignments routed, before drops) and ``dropped``
    (assignments that found no slot) are global counts, the same on every device.
    """

    load_balance: Float[Array, ""]
    router_z: Float[Array, ""]
    tokens_per_expert: Float[Array, " e"]
    dropped: Float[Array, ""]


def route(x: Float[Array, "n d"], router: Float[Array, "d e"], cfg: MoE) -> Routing:
    """Router logits in float32, scores, the top-k experts and their combine weights."""
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), router.astype(jnp.float32))
    if cfg.score == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
    weights, experts = jax.lax.top_k(scores, cfg.top_k)
    if cfg.normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return Routing(experts, weights, probs, logits)


def assign_slots(routing: Routing, cfg: MoE, capacity: int) -> Slots:
    """Each assignment's slot in its expert's buffer, ranked by ``cfg.order``; kept if < C."""
    n, k = routing.experts.shape
    flat = routing.experts.T.reshape(-1)  # choice-major: all first choices, then seconds
    if cfg.order == "score":
        ranking = jnp.argsort(-jax.lax.stop_gradient(routing.weights).T.reshape(-1), stable=True)
    else:
        ranking = jnp.arange(n * k)
    onehot = jax.nn.one_hot(flat[ranking], cfg.experts, dtype=jnp.int32)
    ahead = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # same-expert before it
    position = jnp.zeros_like(ahead).at[ranking].set(ahead).reshape(k, n).T
    return Slots(position, position < capacity)


def dispatch(
    x: Float[Array, "n d"], routing: Routing, slots: Slots, capacity: int
) -> Float[Array, "e c d"]:
    """Packs the kept assignments into per-expert buffers; a dropped one writes nowhere."""
    return _pack(x, routing.experts, slots.position, slots.kept, routing.probs.shape[-1], capacity)


def combine(y: Float[Array, "e c d"], routing: Routing, slots: Slots) -> Float[Array, "n d"]:
    """out[t] = Σ_k kept · weight · y[expert, slot]: each token's expert outputs, weighted."""
    return _unpack(y, routing.experts, slots.position, slots.kept, routing.weights)


def _pack(x: Array, ids: Array, position: Array, keep: Array, experts: int, capacity: int) -> Array:
    """buffers[experts, C, d] holding x[t] at (ids[t, j], position[t, j]) where ``keep``."""
    n, k = ids.shape
    rows = jnp.broadcast_to(x[:, None, :], (n, k, x.shape[-1]))
    slot = jnp.where(keep, position, capacity)  # out of range: written nowhere
    empty = vary_like(jnp.zeros((experts, capacity, x.shape[-1]), x.dtype), x, ids)
    return empty.at[jnp.where(keep, ids, 0), slot].add(rows, mode="drop")


def _unpack(y: Array, ids: Array, position: Array, keep: Array, weights: Array) -> Array:
    """out[t] = Σ_j keep · weights · y[ids[t, j], position[t, j]]."""
    slot = jnp.where(keep, position, y.shape[1])
    picked = y.at[jnp.where(keep, ids, 0), slot].get(mode="fill", fill_value=0)  # [n, k, d]
    return jnp.einsum("nkd,nk->nd", picked, jnp.where(keep, weights, 0.0).astype(y.dtype))


def expert_ffn(
    buffers: Float[Array, "e c d"], p: Params, tp: str | None = None
) -> Float[Array, "e c d"]:
    """SwiGLU per local expert: ``p`` holds gate, up [E_l, d, F_X] and down [E_l, F_X, d];
    F is split over ``tp`` (column then row parallel, one all-reduce; None: no TP)."""
    h = enter_tp(buffers, tp)
    gate = jnp.einsum("ecd,edf->ecf", h, p["gate"].astype(h.dtype))
    up = jnp.einsum("ecd,edf->ecf", h, p["up"].astype(h.dtype))
    y = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, p["down"].astype(h.dtype))
    return exit_tp(y, tp)


def to_experts(buffers: Float[Array, "e c d"], axis: str | None) -> Float[Array, "el xc d"]:
    """EP dispatch: every group's slots of this device's E/X experts ([E/X, X·C, d], groups in
    the axis's order). Experts are split over ``axis`` in contiguous blocks of E/X."""
    if axis is None:
        return buffers
    e, c, d = buffers.shape
    x = axis_size(axis)
    blocks = all_to_all(buffers.reshape(x, e // x, c, d), axis, split_axis=0, concat_axis=0)
    return blocks.transpose(1, 0, 2, 3).reshape(e // x, x * c, d)


def from_experts(y: Float[Array, "el xc d"], axis: str | None) -> Float[Array, "e c d"]:
    """EP combine: each group's slots of every expert back home ([E, C, d])."""
    if axis is None:
        return y
    el, xc, d = y.shape
    x = axis_size(axis)
    blocks = y.reshape(el, x, xc // x, d).transpose(1, 0, 2, 3)
    return all_to_all(blocks, axis, split_axis=0, concat_axis=0).reshape(x * el, xc // x, d)


def ring_of_experts(
    x: Float[Array, "n d"],
    routing: Routing,
    slots: Slots,
    capacity: int,
    p: Params,
    axis: str,
    tp: str | None = None,
) -> Float[Array, "n d"]:
    """EP by all-gather and reduce-scatter (MaxText's ring of experts): every group's tokens,
    combine weights and slots gathered over ``axis``; this device's E/X experts run on their
    slots of all X groups; the partial outputs [X, n, d] reduce-scattered back to [n, d].

    The same slots as the all-to-all dispatch (each group's, decided before the gather), so
    the same result up to the order of the k-sum. Sends (X−1)·n·d·w per all-gather of tokens
    and per reduce-scatter of outputs, against (X−1)/X · E·C·d·w per all-to-all: fewer bytes
    when X < capacity_factor · k.
    """
    n_groups, local = axis_size(axis), p["gate"].shape[0]
    k = routing.experts.shape[1]
    tokens = all_gather(x, axis)  # [X, n, d]
    weights = all_gather(routing.weights, axis)  # [X, n, k]
    ints = all_gather(jnp.concatenate([routing.experts, slots.position], -1), axis)
    ids = ints[..., :k] - axis_index(axis) * local  # this device's experts are 0 .. E/X − 1
    position = ints[..., k:]
    mine = (ids >= 0) & (ids < local) & (position < capacity)

    def pack(t: Array, i: Array, q: Array, m: Array) -> Array:
        return _pack(t, i, q, m, local, capacity)

    buffers = jax.vmap(pack)(tokens, ids, position, mine)
    flat = buffers.transpose(1, 0, 2, 3).reshape(local, n_groups * capacity, -1)
    y = expert_ffn(flat, p, tp).reshape(local, n_groups, capacity, -1).transpose(1, 0, 2, 3)
    partial = jax.vmap(_unpack)(y, ids, position, mine, weights)  # [X, n, d]: my experts' part
    return reduce_scatter(partial, axis)


def _counts(experts: Int[Array, "n k"], num_experts: int) -> Float[Array, " e"]:
    return jax.nn.one_hot(experts, num_experts, dtype=jnp.float32).sum((0, 1))


def _psum(x: Array, axes: Sequence[str]) -> Array:
    return all_reduce(vary(x, axes), tuple(axes)) if axes else x


def load_balance_share(
    routing: Routing,
    cfg: MoE,
    b: int,
    tokens_per_expert: Float[Array, " e"],
    seq_axes: Sequence[str],
    sequences: int,
    length: int,
) -> Float[Array, ""]:
    """This device's share of the load-balance loss.

    ``b``: its sequences (their local parts); ``tokens_per_expert``: the global counts
    (``"batch"``); ``seq_axes``: the axes splitting each sequence (``"sequence"`` sums its
    counts over them); ``sequences``, ``length``: the global batch B and sequence length T.
    """
    if cfg.aux == "batch":
        count = sequences * length
        f = tokens_per_expert / (count * cfg.top_k)
        return cfg.experts * jnp.sum(f * routing.probs.sum(0)) / count
    onehot = jax.nn.one_hot(routing.experts.reshape(b, -1, cfg.top_k), cfg.experts)
    per_seq = jax.lax.stop_gradient(_psum(onehot.astype(jnp.float32).sum((1, 2)), seq_axes))
    p = routing.probs.reshape(b, -1, cfg.experts).sum(1) / length  # this part of each sequence
    return cfg.experts * jnp.sum(per_seq / (length * cfg.top_k) * p) / sequences


def z_loss_share(routing: Routing, count: int) -> Float[Array, ""]:
    """This device's share of mean(logsumexp(logits)²) over ``count`` tokens in all."""
    return jnp.sum(jax.nn.logsumexp(routing.logits, axis=-1) ** 2) / count


def _global_counts(
    routing: Routing, slots: Slots, cfg: MoE, groups: Sequence[str]
) -> tuple[Float[Array, " e"], Float[Array, ""]]:
    """(assignments per expert, dropped assignments) summed over the groups: one all-reduce."""
    local = jnp.concatenate(
        [_counts(routing.experts, cfg.experts), jnp.sum(~slots.kept, dtype=jnp.float32)[None]]
    )
    total = jax.lax.stop_gradient(_psum(local, groups))
    return total[:-1], total[-1]


def moe_layer(
    x: Float[Array, "b t d"],
    p: Params,
    cfg: MoE,
    *,
    expert_axis: str | None = None,
    tp: str | None = None,
    batch_axes: Sequence[str] = (),
    seq_axes: Sequence[str] = (),
    dispatch_by: str = "all_to_all",
) -> tuple[Float[Array, "b t d"], MoEAux]:
    """One MoE FFN on this device's tokens: route, dispatch, (all-to-all), experts, (back),
    combine.

    Args:
      x: this device's tokens, [b, t, d] (one group); invariant over ``tp``.
      p: ``router`` [d, E] (replicated), ``gate`` / ``up`` [E_X, d, F_tp], ``down``
        [E_X, F_tp, d] (experts split over ``expert_axis``, F over ``tp``).
      expert_axis: X, the axis experts are split over (None: every expert here).
      tp: the tensor-parallel axis inside each expert (None: none).
      batch_axes: the axes splitting whole sequences (data, and the expert axis: tokens are
        split over it too); seq_axes: the axes splitting each sequence. Both name the groups
        the counts and the aux losses are reduced over: give every axis the tokens' spec
        names, size 1 included (shard_map types the tokens varying over all of them).
      dispatch_by: ``"all_to_all"`` (``to_experts`` / ``from_experts``) or ``"ring"``
        (``ring_of_experts``: all-gather and reduce-scatter); the same result.

    Returns:
      (out [b, t, d], ``MoEAux``).
    """
    b, t, d = x.shape
    tokens = x.reshape(b * t, d)
    routing = route(tokens, p["router"], cfg)
    capacity = cfg.capacity(b * t)
    slots = assign_slots(routing, cfg, capacity)
    experts = {name: p[name] for name in ("gate", "up", "down")}
    if dispatch_by not in DISPATCHES:
        raise ValueError(f"dispatch_by must be one of {DISPATCHES}, got {dispatch_by!r}.")
    if dispatch_by == "ring" and expert_axis is not None:
        out = ring_of_experts(tokens, routing, slots, capacity, experts, expert_axis, tp)
    else:
        buffers = dispatch(tokens, routing, slots, capacity)
        y = from_experts(expert_ffn(to_experts(buffers, expert_axis), experts, tp), expert_axis)
        out = combine(y, routing, slots)
    out = out.reshape(b, t, d)
    groups = (*batch_axes, *seq_axes)
    tokens_per_expert, dropped = _global_counts(routing, slots, cfg, groups)
    sequences = b * math.prod(axis_size(a) for a in batch_axes)
    length = t * math.prod(axis_size(a) for a in seq_axes)
    share = load_balance_share(routing, cfg, b, tokens_per_expert, seq_axes, sequences, length)
    aux = MoEAux(
        load_balance=share,
        router_z=z_loss_share(routing, sequences * length),
        tokens_per_expert=tokens_per_expert,
        dropped=dropped,
    )
    return out, aux
