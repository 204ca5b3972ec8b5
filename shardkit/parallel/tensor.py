"""Tensor parallelism over one mesh axis (usually ``model``), Megatron style.

Primitives for ``shard_map`` bodies; they take plain arrays, param dicts ``{"kernel", "bias"}``
holding this device's fragment, and an axis name. Nothing here assumes a ViT.

A TP region starts where an activation replicated over the axis enters column-parallel matmuls
and ends where row-parallel partial sums are reduced:

  enter:  x[B, T, D] -> x[B, T, D] (typed varying)        Megatron f: all-reduce in backward
          or, sequence-parallel: x[B, T_X, D] -> x[B, T, D]   all-gather (reduce-scatter back)
  column: x[B, T, D] · W[D, F_X] -> h[B, T, F_X]            local
  row:    h[B, T, F_X] · W[F_X, D] -> y[B, T, D]{U_X}       local
  exit:   y{U_X} -> y[B, T, D]                            Megatron g: all-reduce
          or, sequence-parallel: y{U_X} -> y[B, T_X, D]      reduce-scatter (all-gather back)

Enter once per region, not once per matmul: autodiff does not merge reductions, so an
activation typed invariant that feeds q, k and v projections separately would all-reduce three
cotangents in backward instead of one (see ``shardkit.collectives.megatron_f``).
Bias: a column-parallel bias is split like its output (``b[F_X]``); a row-parallel bias is
whole (``b[D]``) and added once, after the reduction. Every bias is optional (Llama has none):
a param dict without ``"bias"`` adds nothing.

Overlap (``overlap=True``, Megatron-SP only): the entry's all-gather and the region's column
matmuls become one ``overlap.ag_matmul`` (the column kernels concatenated), the row matmul and
the exit's reduce-scatter one ``overlap.matmul_rs``: ring steps whose permutes a TPU schedules
under the matmuls; ``overlap="bidirectional"``: rings of half blocks both ways (each device's
token rows, local batch × local tokens, must be even). The tokens travel in the compute dtype
(the plain entry gathers the float32 LayerNorm output); the bytes are otherwise the plain
region's.

Plain TP's overlap (``pipelined_regions``, Domino's schedule): each device's batch is cut in
two halves, A and B, that run every region in turn, A then B. A region is written as its
``columns`` (LayerNorm, Megatron f with a permuted backward, the column matmuls) and ``rows``
(the core or the activation, the row matmul, unreduced), so that each half's all-reduce can
travel beside the other half's column matmuls: A's beside B's in the same region, B's beside
A's in the next (one region behind, across layers). All-reduces run as a reduce-scatter of
permutes and an all-gather (``overlap.reduce_beside``, ``overlap.reduced_back``); backward,
each half's entry all-reduce runs under the other half's backward. The bytes are plain TP's.

Decoder blocks: ``attention_tp`` takes a ``rope`` hook (``lm.rope``: rotary embeddings at the
tokens' GLOBAL positions) and ``kv_repeat`` (KV heads fewer than the TP degree: K / V weights
kept whole, each device projects the one KV head its query heads share); ``gated_mlp_tp`` is
the SwiGLU MLP (gate and up column-parallel, down row-parallel: still one reduction).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from shardkit.parallel import overlap as ov
from shardkit.parallel.collectives import (
    all_gather,
    axis_index,
    axis_size,
    megatron_f,
    megatron_g,
    reduce_scatter,
    shard_map_primitive,
)

Params = dict[str, Any]
AttentionCore = Callable[[Array, Array, Array], Array]
Rope = Callable[[Array, Array], tuple[Array, Array]]


def _cast(x: Array, dtype: jnp.dtype | None) -> Array:
    return x if dtype is None else x.astype(dtype)


def add_bias(y: Array, b: Array | None) -> Array:
    """``y + b`` with ``b`` broadcast over ``y``'s leading axes (explicit, rank-safe); None: y."""
    if b is None:
        return y
    return y + b.reshape((1,) * (y.ndim - b.ndim) + b.shape).astype(y.dtype)


def _bias(p: Params, dtype: jnp.dtype | None) -> Array | None:
    return _cast(p["bias"], dtype) if "bias" in p else None


OVERLAP = (False, True, "bidirectional")  # the values ``overlap`` takes


def _overlapped(axis: str | None, token_dim: int | None, overlap: bool | str) -> bool:
    """Whether this region runs as collective matmuls (``overlap`` needs Megatron-SP)."""
    if overlap not in OVERLAP:
        raise ValueError(f"overlap must be one of {OVERLAP}, got {overlap!r}.")
    if overlap and token_dim != 1:
        raise ValueError(
            f"overlap={overlap!r} needs a sequence-parallel region (token_dim=1): only "
            "Megatron-SP's all-gather and reduce-scatter run as collective matmuls."
        )
    return bool(overlap) and axis is not None


def _columns_gathered(
    x: Array, ps: list[Params], axis: str, dtype: jnp.dtype | None, overlap: bool | str = True
) -> list[Array]:
    """``enter_tp(x, token_dim=1)`` and one column-parallel matmul per param dict, as ONE
    ``ag_matmul``: x[B, T_X, D] · [W_1 | W_2 | ...][D, F] -> [y_1, y_2, ...] each [B, T, F_i]
    (a kernel [D, ...] is flattened to [D, F_i]; the outputs keep its trailing shape)."""
    b, t, d = x.shape
    kernels = [_cast(p["kernel"], dtype) for p in ps]
    w = jnp.concatenate([k.reshape(d, -1) for k in kernels], axis=1)
    rows = jnp.swapaxes(_cast(x, dtype), 0, 1).reshape(t * b, d)  # token-major rows
    y = ov.ag_matmul(rows, w, axis, overlap == "bidirectional")  # [n·t·b, F]: device-major
    y = jnp.swapaxes(y.reshape(-1, b, w.shape[1]), 0, 1)
    splits = [int(k.size // d) for k in kernels]
    outs = jnp.split(y, [sum(splits[:i]) for i in range(1, len(splits))], axis=2)
    return [
        add_bias(o.reshape(b, -1, *k.shape[1:]), _bias(p, dtype))
        for o, k, p in zip(outs, kernels, ps, strict=True)
    ]


def _row_scattered(
    h: Array, p: Params, axis: str, dtype: jnp.dtype | None, overlap: bool | str = True
) -> Array:
    """``dense_row`` + ``exit_tp(token_dim=1)`` as ONE ``matmul_rs``: h[B, T, ...F_X] ·
    W[F_X, D] {U_X} -> y[B, T_X, D] + b[D]."""
    b, t = h.shape[:2]
    kernel = _cast(p["kernel"], dtype)
    w = kernel.reshape(-1, kernel.shape[-1])
    rows = jnp.swapaxes(_cast(h, dtype), 0, 1).reshape(t * b, w.shape[0])
    y = ov.matmul_rs(rows, w, axis, overlap == "bidirectional")  # [t/n · b, D]: own tokens
    return add_bias(jnp.swapaxes(y.reshape(-1, b, w.shape[1]), 0, 1), _bias(p, dtype))


@shard_map_primitive
def enter_tp(x: Array, axis: str | None, *, token_dim: int | None = None) -> Array:
    """Start a TP region: Megatron f, or an all-gather of tokens for sequence parallelism.

    ``token_dim=None``: ``x[B, T, D] -> x[B, T, D]`` typed varying; backward all-reduces the
    cotangent ``{U_X}``. ``token_dim=1``: ``x[B, T_X, D] -> x[B, T, D]``; backward
    reduce-scatters the cotangent back to token shards (same bytes, no all-reduce).
    ``axis=None`` (no tensor parallelism) returns x unchanged.
    """
    if axis is None:
        return x
    if token_dim is None:
        return megatron_f(x, axis)
    # Megatron-SP: gather the token shards every column-parallel matmul needs.
    return all_gather(x, axis, axis_dim=token_dim, tiled=True)


@shard_map_primitive
def exit_tp(y_partial: Array, axis: str | None, *, token_dim: int | None = None) -> Array:
    """End a TP region: ``y{U_X}`` -> all-reduced (Megatron g) or reduce-scattered over tokens."""
    if axis is None:
        return y_partial
    if token_dim is None:
        return megatron_g(y_partial, axis)
    # Megatron-SP: sum the partial products and keep only this device's token shard.
    return reduce_scatter(y_partial, axis, scatter_dim=token_dim, tiled=True)


def dense_column(x: Array, p: Params, spec: str, dtype: jnp.dtype | None = None) -> Array:
    """Column-parallel dense: ``x[..., D] · W[D, F_X] + b[F_X] -> y[..., F_X]``, no communication.

    ``x`` must already be varying over the axis (from ``enter_tp``); ``spec`` is the einsum,
    e.g. ``"btd,dhk->bthk"`` for a head-split projection. ``p["bias"]`` is optional.
    """
    y = jnp.einsum(spec, _cast(x, dtype), _cast(p["kernel"], dtype))
    return add_bias(y, _bias(p, dtype))


@shard_map_primitive
def dense_row(
    x: Array,
    p: Params,
    spec: str,
    axis: str | None,
    dtype: jnp.dtype | None = None,
    *,
    token_dim: int | None = None,
) -> Array:
    """Row-parallel dense: ``x[..., F_X] · W[F_X, D] -> {U_X}``, reduced by ``exit_tp``, + b[D]
    (``p["bias"]`` optional)."""
    y_partial = jnp.einsum(spec, _cast(x, dtype), _cast(p["kernel"], dtype))
    return add_bias(exit_tp(y_partial, axis, token_dim=token_dim), _bias(p, dtype))


@shard_map_primitive
def attention_tp(
    x: Float[Array, "b t d"],
    p: Params,
    axis: str | None,
    core: AttentionCore,
    dtype: jnp.dtype | None = None,
    *,
    token_dim: int | None = None,
    rope: Rope | None = None,
    kv_repeat: bool = False,
    overlap: bool | str = False,
) -> Float[Array, "b t d"]:
    """Self-attention with heads split over ``axis``.

    ``x[B, T, D]`` (or ``x[B, T_X, D]`` with ``token_dim``) · ``W_qkv[D, H_X, K]`` -> ``q, k,
    v[B, T, H_X, K]`` -> ``core`` -> ``o`` · ``W_o[H_X, K, D]`` -> ``{U_X}`` -> reduced. One
    forward and one backward reduction per call, whatever the number of projections.

    Args:
      x: local activations [b, t, d], invariant over ``axis`` (``[b, t/n, d]`` with
        ``token_dim=1``: Megatron-SP gathers the tokens first).
      p: this device's fragments, every bias optional:
        ``query`` / ``key`` / ``value``: ``{"kernel": [d, h/n, k], "bias": [h/n, k]}``;
        ``out``: ``{"kernel": [h/n, k, d], "bias": [d]}`` (the bias whole: it is added once,
        after the reduction). Split over ``axis`` along the heads dim, as
        ``vit_ref.param_axes`` names it ("heads"). Grouped-query attention: ``key`` and
        ``value`` with h_kv heads ([d, h_kv/n, k], h_kv divisible by n, and h/h_kv query heads
        per KV head on every device); the sequence cores accept it. With ``kv_repeat``,
        ``key`` / ``value`` are whole ([d, h_kv, k], not split over ``axis``).
      axis: the tensor-parallel mesh axis, or None (no split: plain attention).
      core: ``core(q, k, v) -> o`` on local heads, [b, t, h/n, k] each (plain, ring, Ulysses,
        masked...); it scales the scores by 1/√k (``sequence``'s cores do), nothing here does.
      dtype: compute dtype of the matmuls (None: the params' dtype).
      token_dim: 1 for Megatron-SP (tokens split over ``axis`` outside the region).
      rope: ``rope(q, k) -> (q, k)``, applied after the projections (``lm.rope(positions)``:
        the positions of the tokens this region holds, global ones under a sequence layout).
      kv_repeat: K / V weights whole on every device, for fewer KV heads than devices
        (h_kv < n, n a multiple of h_kv): device i projects only KV head i·h_kv/n, the one its
        h/n query heads use (no K / V activation is repeated or sent). Their gradients are
        partial per device and summed over ``axis`` like any replicated weight's.
      overlap: Megatron-SP's entry and exit as collective matmuls (module docstring).

    Returns:
      [b, t, d] (or [b, t/n, d] with ``token_dim``), invariant over ``axis``.
    """
    kv = {name: p[name] for name in ("key", "value")}
    if kv_repeat:
        kv = {name: _kv_head_of_device(w, axis) for name, w in kv.items()}
    projections = [p["query"], kv["key"], kv["value"]]
    if _overlapped(axis, token_dim, overlap):
        q, k, v = _columns_gathered(x, projections, axis, dtype, overlap)  # type: ignore[arg-type]
    else:
        x = enter_tp(x, axis, token_dim=token_dim)
        q, k, v = (dense_column(x, w, "btd,dhk->bthk", dtype) for w in projections)
    if rope is not None:
        q, k = rope(q, k)
    o = core(q, k, v)
    if _overlapped(axis, token_dim, overlap):
        return _row_scattered(o, p["out"], axis, dtype, overlap)  # type: ignore[arg-type]
    return dense_row(o, p["out"], "bthk,hkd->btd", axis, dtype, token_dim=token_dim)


def _kv_head_of_device(p: Params, axis: str | None) -> Params:
    """The KV head this device's query heads share, sliced out of whole ``[d, h_kv, k]``
    weights (``kv_repeat``): head ``i·h_kv/n`` on device i of n."""
    if axis is None:
        return p
    n, h_kv = axis_size(axis), p["kernel"].shape[1]
    if h_kv >= n or n % h_kv:
        raise ValueError(
            f"kv_repeat needs more devices on {axis!r} ({n}) than KV heads ({h_kv}), and a "
            f"multiple of them; with h_kv >= n split the KV heads over {axis!r} instead."
        )
    head = axis_index(axis) * h_kv // n
    return {
        name: jax.lax.dynamic_slice_in_dim(w, head, 1, axis=1 if name == "kernel" else 0)
        for name, w in p.items()
    }


@shard_map_primitive
def mlp_tp(
    x: Float[Array, "b t d"],
    p: Params,
    axis: str | None,
    activation: Callable[[Array], Array],
    dtype: jnp.dtype | None = None,
    *,
    token_dim: int | None = None,
    overlap: bool | str = False,
) -> Float[Array, "b t d"]:
    """Megatron MLP: ``x[B, T, D] · W1[D, F_X] -> act -> · W2[F_X, D] -> {U_X}`` -> reduced.

    One reduction per block forward (none between the two matmuls) and one backward.

    Args:
      x: local activations [b, t, d], invariant over ``axis`` ([b, t/n, d] with ``token_dim``).
      p: this device's fragments, both biases optional:
        ``fc1``: ``{"kernel": [d, f/n], "bias": [f/n]}`` (column-parallel);
        ``fc2``: ``{"kernel": [f/n, d], "bias": [d]}`` (row-parallel; the bias whole, added
        once after the reduction).
      axis: the tensor-parallel mesh axis, or None (no split).
      activation: elementwise, e.g. ``jax.nn.gelu`` (applied to the local hidden block).
      dtype: compute dtype of the matmuls (None: the params' dtype).
      token_dim: 1 for Megatron-SP.
      overlap: Megatron-SP's entry and exit as collective matmuls (module docstring).

    Returns:
      [b, t, d] (or [b, t/n, d] with ``token_dim``), invariant over ``axis``.
    """
    if _overlapped(axis, token_dim, overlap):
        (h,) = _columns_gathered(x, [p["fc1"]], axis, dtype, overlap)  # type: ignore[arg-type]
        return _row_scattered(activation(h), p["fc2"], axis, dtype, overlap)  # type: ignore[arg-type]
    x = enter_tp(x, axis, token_dim=token_dim)
    h = activation(dense_column(x, p["fc1"], "btd,df->btf", dtype))
    return dense_row(h, p["fc2"], "btf,fd->btd", axis, dtype, token_dim=token_dim)


@shard_map_primitive
def gated_mlp_tp(
    x: Float[Array, "b t d"],
    p: Params,
    axis: str | None,
    activation: Callable[[Array], Array] = jax.nn.silu,
    dtype: jnp.dtype | None = None,
    *,
    token_dim: int | None = None,
) -> Float[Array, "b t d"]:
    """Gated MLP (SwiGLU with ``silu``): ``act(x · W_gate[D, F_X]) ⊙ (x · W_up[D, F_X])
    · W_down[F_X, D] -> {U_X}`` -> reduced. Gate and up are column-parallel on the same F
    split, so the product is local: one reduction forward and one backward, as ``mlp_tp``.

    Args:
      x: local activations [b, t, d], invariant over ``axis`` ([b, t/n, d] with ``token_dim``).
      p: ``gate`` / ``up``: ``{"kernel": [d, f/n]}``; ``down``: ``{"kernel": [f/n, d]}``;
        biases optional (``[f/n]``, ``[f/n]``, ``[d]``).
      axis: the tensor-parallel mesh axis, or None (no split).
      activation: applied to the gate (``jax.nn.silu``: SwiGLU; ``jax.nn.gelu``: GeGLU).
      dtype: compute dtype of the matmuls (None: the params' dtype).
      token_dim: 1 for Megatron-SP.

    Returns:
      [b, t, d] (or [b, t/n, d] with ``token_dim``), invariant over ``axis``.
    """
    x = enter_tp(x, axis, token_dim=token_dim)
    gate = activation(dense_column(x, p["gate"], "btd,df->btf", dtype))
    h = gate * dense_column(x, p["up"], "btd,df->btf", dtype)
    return dense_row(h, p["down"], "btf,fd->btd", axis, dtype, token_dim=token_dim)


@dataclasses.dataclass(frozen=True)
class Region:
    """One plain-TP region cut where its reductions go, for ``pipelined_regions``.

    ``norm(x[B, T, D])``: what runs before the entry (LayerNorm; default none);
    ``columns(h) -> u``: the column matmuls of the entered h (varying over the axis);
    ``rows(u) -> y[B, T, D]{U_X}``: the rest up to the row matmul, unreduced; ``bias``: the
    row bias b[D], added after the sum (None: none). The output is ``x + (Σ_X y + b)``.
    """

    columns: Callable[[Array], Any]
    rows: Callable[[Any], Array]
    bias: Array | None = None
    norm: Callable[[Array], Array] = lambda x: x


class Halves(NamedTuple):
    """The residual stream of ``pipelined_regions``: each half-batch's ``[B/2, T, D]``
    (invariant over the TP axis), and B's last row output ``{U_X}`` not yet reduced with its
    region's row bias (None before the first region)."""

    a: Array
    b: Array
    pending: Array | None = None
    bias: Array | None = None


def split_halves(x: Float[Array, "b t d"]) -> Halves:
    """``x[B, T, D]`` as two half-batches (B even: ValueError, one sentence, otherwise)."""
    if x.shape[0] % 2:
        raise ValueError(
            f"Plain TP's overlap cuts each device's batch in two halves; a local batch of "
            f"{x.shape[0]} does not split (give an even batch per data shard)."
        )
    a, b = jnp.split(x, 2, axis=0)
    return Halves(a, b)


def join_halves(h: Halves, axis: str | None) -> Array:
    """``x[B, T, D]`` from ``Halves``: B's pending row output reduced (nothing is left to
    hide it under) and added with its bias, and the halves concatenated."""
    b = h.b
    if h.pending is not None:
        y = h.pending if axis is None else ov.all_reduce_permuted(h.pending, axis)
        b = b + add_bias(y, h.bias).astype(b.dtype)
    return jnp.concatenate([h.a, b], axis=0)


def run_halves(
    x: Array,
    one: Callable[[Any, Any], Any],
    run: Callable[[Any, Any], Any],
    stack: Any,
    *,
    scanned: bool,
    axis: str = "model",
) -> Array:
    """A layer loop ``run(h, stack)`` on Domino's halves: ``x[B, T, D]`` split, the loop, B's
    last output reduced and the halves joined. The halves carry B's output unreduced from
    layer to layer: ``scanned`` (stacked leaves, a ``lax.scan`` in ``run``), layer 0, which
    has none to take in, runs alone (``one(h, layer)``) before the scan, whose carry then keeps
    one structure; otherwise ``run`` is a Python loop and takes every layer."""
    h = split_halves(x)
    if scanned:
        h = one(h, jax.tree.map(lambda a: a[0], stack))
        depth = jax.tree.leaves(stack)[0].shape[0]
        stack = jax.tree.map(lambda a: a[1:], stack) if depth > 1 else None
    return join_halves(h if stack is None else run(h, stack), axis)


@shard_map_primitive
def pipelined_regions(h: Halves, regions: Sequence[Region], axis: str | None) -> Halves:
    """Plain TP regions in Domino's two-half schedule (module docstring): per region, A's
    columns (beside B's pending reduction), A's rows, B's columns (beside A's reduction), B's
    rows (left pending for the next region, or ``join_halves``).

    Backward mirrors it: each half's entry (``overlap.reduced_back``) is tied to the other
    half's latest row output (``overlap.tied_in_backward``), so that the entry's all-reduce
    starts with that output's backward matmuls (A's with B's, B's with A's).

    ``h``: ``Halves`` of ``x[B/2, T, D]`` invariant over ``axis`` (``split_halves``), B's
    pending output carried from the last call (a layer's regions per call, layer after
    layer; ``join_halves`` ends the stack); ``regions`` in order (a pre-LN block: attention,
    then MLP). Cost: each region's all-reduce once per half, forward (Megatron g) and backward
    (f): plain TP's bytes, as permutes and all-gathers over ``axis``. ``axis=None``: no
    reduction, the same schedule.
    """
    a, b, pending, pending_bias = h
    for region in regions:
        h_a, pending = _entered_beside(region.norm(a), pending, axis)
        u = region.columns(h_a)
        if pending is not None:
            reduced, u = _reduce_beside(pending, u, axis)
            b = b + add_bias(reduced, pending_bias).astype(b.dtype)
        y = region.rows(u)
        h_b, y = _entered_beside(region.norm(b), y, axis)
        y, u = _reduce_beside(y, region.columns(h_b), axis)
        a = a + add_bias(y, region.bias).astype(a.dtype)
        pending, pending_bias = region.rows(u), region.bias
    return Halves(a, b, pending, pending_bias)


def _entered_beside(x: Array, other: Array | None, axis: str | None) -> tuple[Array, Any]:
    """(Megatron f of x with its backward all-reduce as permutes, ``other``), tied in backward
    (``overlap.tied_in_backward``): x's cotangent is released with ``other``'s, so that its
    all-reduce travels while ``other``'s backward matmuls run."""
    if axis is None:
        return x, other
    x = ov.reduced_back(x, axis)
    return (x, other) if other is None else ov.tied_in_backward(x, other)


def attention_region(
    p: Params,
    axis: str | None,
    core: AttentionCore,
    dtype: jnp.dtype | None = None,
    *,
    norm: Callable[[Array], Array] = lambda x: x,
    rope: Rope | None = None,
    kv_repeat: bool = False,
) -> Region:
    """``attention_tp`` (plain TP) as a ``Region``: ``norm``, then columns q, k, v (one
    entry); rows rope, ``core`` and ``o · W_o[H_X, K, D]`` unreduced; bias ``out``'s. Params,
    ``core``, ``rope`` and ``kv_repeat`` as ``attention_tp``'s."""
    kv = {name: p[name] for name in ("key", "value")}
    if kv_repeat:
        kv = {name: _kv_head_of_device(w, axis) for name, w in kv.items()}
    projections = [p["query"], kv["key"], kv["value"]]

    def columns(x: Array) -> tuple[Array, ...]:
        return tuple(dense_column(x, w, "btd,dhk->bthk", dtype) for w in projections)

    def rows(qkv: tuple[Array, ...]) -> Array:
        q, k, v = qkv
        if rope is not None:
            q, k = rope(q, k)
        o = core(q, k, v)
        return jnp.einsum("bthk,hkd->btd", _cast(o, dtype), _cast(p["out"]["kernel"], dtype))

    return Region(columns, rows, _bias(p["out"], dtype), norm)


def mlp_region(
    p: Params,
    activation: Callable[[Array], Array],
    dtype: jnp.dtype | None = None,
    *,
    norm: Callable[[Array], Array] = lambda x: x,
) -> Region:
    """``mlp_tp`` (plain TP) as a ``Region``: ``norm``, then columns ``h · W1[D, F_X] + b1``;
    rows ``activation`` and ``· W2[F_X, D]`` unreduced; bias ``fc2``'s."""

    def columns(x: Array) -> Array:
        return dense_column(x, p["fc1"], "btd,df->btf", dtype)

    def rows(h: Array) -> Array:
        return jnp.einsum(
            "btf,fd->btd", _cast(activation(h), dtype), _cast(p["fc2"]["kernel"], dtype)
        )

    return Region(columns, rows, _bias(p["fc2"], dtype), norm)


def _reduce_beside(y: Array, beside: Any, axis: str | None) -> tuple[Array, Any]:
    return (y, beside) if axis is None else ov.reduce_beside(y, beside, axis)


__all__ = [
    "Halves",
    "Region",
    "add_bias",
    "attention_region",
    "attention_tp",
    "dense_column",
    "dense_row",
    "enter_tp",
    "exit_tp",
    "gated_mlp_tp",
    "join_halves",
    "mlp_region",
    "mlp_tp",
    "pipelined_regions",
    "run_halves",
    "split_halves",
]
