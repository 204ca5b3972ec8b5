"""Collective matmuls: a matmul fused with the all-gather or reduce-scatter it needs, as ring
steps, so that each step's matmul can run while the next block travels.

  ag_matmul   x[M_X, K] · w[K, F] -> y[M, F]          the all-gather of x hidden under the
              matmul (Megatron-SP's entry into a column-parallel region: tokens gathered)
  matmul_rs   a[M, K] · w[K, F] {U_X} -> y[M_X, F]    the reduce-scatter of the product hidden
              under it (the exit of a row-parallel region: token blocks summed and split)

Forward: n − 1 ``ppermute`` steps of one block each (device i → i + 1, ``ring_shift``). In
``ag_matmul`` step s multiplies the block that started on device i − s while it is passed on;
in ``matmul_rs`` the partial sum of one output block travels while the next block's product
is computed. No step's matmul waits on the permute issued beside it, so a scheduler with
asynchronous collectives (the TPU's) can run each permute under a matmul; XLA:CPU runs them
one after the other, with the same bytes.

Backward (``jax.custom_vjp``), again collective matmuls in the other direction:
  ``ag_matmul``: dx = matmul_rs(dy, wᵀ); dw = x_gatheredᵀ · dy, from the gathered x kept as
  the residual (as the transpose of a plain ``all_gather`` keeps it);
  ``matmul_rs``: da = ag_matmul(dy, wᵀ), whose ring also gathers dy for dw = aᵀ · dy_gathered.
Bytes per device, forward and backward alike: (n − 1)/n · V, exactly the plain all-gather's
or reduce-scatter's, in n − 1 permutes instead of one collective.

``bidirectional=True`` uses both directions of every ring link: each block is cut in two
halves (its rows must be even), the first halves travel i → i + 1 and the second i → i − 1,
each ring n − 1 steps of half a block. The same bytes in 2(n − 1) permutes, every step's two
half-block hops on two different links at once (a TPU's ICI links are full duplex, so a step
takes half the time of a one-way whole-block hop; on a ring of 2 both hops share the one
neighbour).

Plain TP's all-reduces (Megatron g forward, f backward) as permutes, for a TPU to hide beside
the other half-batch's matmuls (``tensor.pipelined_regions``):
  all_reduce_permuted  y{U_X} -> y            a reduce-scatter of permutes
                                              (``scatter_by_permutes``) then an all-gather
  reduced_back         x -> x (typed varying)  Megatron f whose backward is that all-reduce
  reduce_beside        (y{U_X}, u) -> (y, u)   Megatron g whose reduce-scatter is tied to u
                                              (an optimization barrier), identity backward
Bytes: 2(n − 1)/n · V (V padded to [n, r, 128]), an all-reduce's.

Every function runs inside a ``shard_map`` body; ``axis`` is one mesh axis name; x, a and w are
varying over it (split, or partial); M is the leading dim.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from shardkit.parallel.collectives import (
    all_gather,
    axis_index,
    axis_size,
    halving_reduce_scatter,
    ring_reduce_scatter,
    ring_shift,
)
from shardkit.parallel.tiles import LANES
from shardkit.parallel.vma import Axis, shard_map_primitive, vary, varying_axes


def _halves(rows: int, what: str, bidirectional: bool) -> list[tuple[int, int]]:
    """(first row, direction) of each part of a block of ``rows`` that travels on its own: the
    whole block along +1, or under ``bidirectional`` its first half along +1 and its second
    along −1."""
    if not bidirectional:
        return [(0, 1)]
    if rows % 2:
        raise ValueError(f"{what}, bidirectional: a block of {rows} rows does not split in halves.")
    return [(0, 1), (rows // 2, -1)]


def _gather_matmul(
    x: jax.Array, w: jax.Array, axis: str, bidirectional: bool = False
) -> tuple[jax.Array, jax.Array]:
    """(x_gathered · w, x_gathered): each arriving part multiplied and put in place, the next
    hop issued first: after s hops in direction d the part in hand started on device i − d·s."""
    n, m, i = axis_size(axis), x.shape[0], axis_index(axis)
    parts = _halves(m, "ag_matmul", bidirectional)
    size = m // len(parts)
    held = [jax.lax.slice_in_dim(vary(x, axis), start, start + size) for start, _ in parts]
    y = jnp.zeros((n * m, w.shape[-1]), jnp.result_type(x, w))
    gathered = jnp.zeros((n * m, *x.shape[1:]), x.dtype)
    for s in range(n):
        hops = zip(held, parts, strict=True)
        arriving = [ring_shift(h, axis, d) for h, (_, d) in hops] if s < n - 1 else []
        products = [h @ w for h in held]
        if arriving:
            # The next hops leave once these products are done: matmuls under each permute
            # (left free, the scheduler ran the hops back to back and the matmuls after).
            arriving, products = jax.lax.optimization_barrier((arriving, products))
        for h, product, (start, d) in zip(held, products, parts, strict=True):
            at = (i - d * s) % n * m + start
            y = jax.lax.dynamic_update_slice_in_dim(y, product, at, 0)
            gathered = jax.lax.dynamic_update_slice_in_dim(gathered, h, at, 0)
        held = arriving or held
    return y, gathered


def _matmul_scatter(
    a: jax.Array, w: jax.Array, axis: str, bidirectional: bool = False
) -> jax.Array:
    """Σ_X (a · w), each device keeping its row block: the partial sum of block k's part that
    travels in direction d starts on device k + d and gains each device's product on its way
    to device k."""
    n, i = axis_size(axis), axis_index(axis)
    if a.shape[0] % n:
        raise ValueError(f"matmul_rs: {a.shape[0]} rows do not split over {axis}={n}.")
    rows = a.shape[0] // n
    parts = _halves(rows, "matmul_rs", bidirectional)
    size = rows // len(parts)
    a = vary(a, axis)
    part = lambda k, start: jax.lax.dynamic_slice_in_dim(a, k * rows + start, size, 0)  # noqa: E731
    accs = [part((i - d) % n, start) @ w for start, d in parts]
    for s in range(1, n):
        # This step's rows are released with the sums that travel beside their products (left
        # free, the scheduler ran every product first and the hops bare), and the products
        # are fusions of their own (fused into the add, they would wait for the hop).
        now = [part((i - d * (s + 1)) % n, start) for start, d in parts]
        now, accs = jax.lax.optimization_barrier((now, accs))
        products = jax.lax.optimization_barrier([r @ w for r in now])
        hops = zip(accs, products, parts, strict=True)
        accs = [ring_shift(acc, axis, d) + p for acc, p, (_, d) in hops]
    return jnp.concatenate(accs, axis=0) if len(accs) > 1 else accs[0]


@shard_map_primitive
def ag_matmul(x: jax.Array, w: jax.Array, axis: str, bidirectional: bool = False) -> jax.Array:
    """``all_gather(x, axis, tiled) @ w`` with the gather hidden under the matmul:
    ``x[M_X, K] · w[K, F] -> y[M, F]``. Cost: (n − 1)/n · |x_gathered| per device forward
    (n − 1 permutes; ``bidirectional``: 2(n − 1) of half a block, M_X even), the same backward
    (dx's reduce-scatter in the same form)."""
    return _ag_matmul(x, w, axis, _types(x, w), bidirectional)


@shard_map_primitive
def matmul_rs(a: jax.Array, w: jax.Array, axis: str, bidirectional: bool = False) -> jax.Array:
    """``reduce_scatter(a @ w, axis, tiled)`` with the scatter hidden under the matmul:
    ``a[M, K] · w[K, F] {U_X} -> y[M_X, F]``. Cost: (n − 1)/n · |a · w| per device forward
    (n − 1 permutes; ``bidirectional``: 2(n − 1) of half a block, M_X even), the same backward
    (da's all-gather of dy in the same form)."""
    return _matmul_rs(a, w, axis, _types(a, w), bidirectional)


Types = tuple[tuple[str, ...], tuple[str, ...]]


def _types(*xs: jax.Array) -> Types:
    """The inputs' varying axes (static): the cotangents must come back typed the same."""
    return tuple(tuple(sorted(varying_axes(x))) for x in xs)  # type: ignore[return-value]


def _typed(ct: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``ct`` summed over the axes it varies over and its primal did not (the transpose of
    the implicit cast that made the primal varying there)."""
    extra = tuple(sorted(varying_axes(ct) - set(axes)))
    return jax.lax.psum(ct, extra) if extra else ct


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _ag_matmul(x: jax.Array, w: jax.Array, axis: str, types: Types, bidi: bool) -> jax.Array:
    return _gather_matmul(x, w, axis, bidi)[0]


def _ag_matmul_fwd(x: jax.Array, w: jax.Array, axis: str, types: Types, bidi: bool) -> tuple:
    y, gathered = _gather_matmul(x, w, axis, bidi)
    return y, (gathered, w)


def _ag_matmul_bwd(axis: str, types: Types, bidi: bool, res: tuple, dy: jax.Array) -> tuple:
    gathered, w = res
    dx, dw = _matmul_scatter(dy, w.T, axis, bidi), gathered.T @ dy
    return _typed(dx, types[0]), _typed(dw, types[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul_rs(a: jax.Array, w: jax.Array, axis: str, types: Types, bidi: bool) -> jax.Array:
    return _matmul_scatter(a, w, axis, bidi)


def _matmul_rs_fwd(a: jax.Array, w: jax.Array, axis: str, types: Types, bidi: bool) -> tuple:
    return _matmul_scatter(a, w, axis, bidi), (a, w)


def _matmul_rs_bwd(axis: str, types: Types, bidi: bool, res: tuple, dy: jax.Array) -> tuple:
    a, w = res
    da, dy_gathered = _gather_matmul(dy, w.T, axis, bidi)
    return _typed(da, types[0]), _typed(a.T @ dy_gathered, types[1])


_ag_matmul.defvjp(_ag_matmul_fwd, _ag_matmul_bwd)
_matmul_rs.defvjp(_matmul_rs_fwd, _matmul_rs_bwd)


@shard_map_primitive
def scatter_by_permutes(x: jax.Array, axis: Axis) -> jax.Array:
    """``reduce_scatter`` built from ``ppermute`` alone, ``x[n, ...]{U_X} -> x[...]``
    (untiled: device k keeps the sum of block k), for a scheduler to hide: recursive halving
    (``halving_reduce_scatter``, log2(n) exchanges) when n is a power of two, else a ring
    (``ring_reduce_scatter``, n − 1 permutes). Either sends (n − 1)/n · V, a reduce-scatter's
    bytes. The TPU compiler runs a reduce-scatter or an all-reduce synchronously wherever it
    stands, but schedules each permute beside a matmul that does not need it; a ring's n − 1
    dependent steps outnumbered the matmuls the scheduler gave them (one step of ViT-B/16's
    7 per layer stayed bare), recursive halving's 3 did not."""
    n = axis_size(axis)
    if n & (n - 1) == 0:
        return halving_reduce_scatter(x, axis)
    return ring_reduce_scatter(x, axis)


@shard_map_primitive
def gather_permuted_back(x: jax.Array, axis: str) -> jax.Array:
    """``all_gather(x, axis)`` (stacked, ``x[...] -> [n, ...]``) whose backward reduce-scatters
    the cotangent ``[n, ...]{U_X}`` with permutes (``scatter_by_permutes``) instead of one
    reduce-scatter.

    FSDP's prefetch (``data.prefetch_layers``) puts the transpose of layer i + 1's gather in
    layer i's backward step, where it depends on nothing that step computes: as permutes it
    travels under layer i's backward matmuls (docs/strategies/overlap.md).
    Cost: (n − 1)/n · V forward and backward, exactly the plain gather's and reduce-scatter's.
    """
    return _gather_permuted_back(x, axis, _types(x)[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_permuted_back(x: jax.Array, axis: str, types: tuple[str, ...]) -> jax.Array:
    return all_gather(x, axis)


def _gather_back_fwd(x: jax.Array, axis: str, types: tuple[str, ...]) -> tuple:
    return all_gather(x, axis), None


def _gather_back_bwd(axis: str, types: tuple[str, ...], _: None, ct: jax.Array) -> tuple:
    return (_typed(scatter_by_permutes(ct, axis), types),)


_gather_permuted_back.defvjp(_gather_back_fwd, _gather_back_bwd)


def _laid(x: jax.Array, n: int) -> jax.Array:
    """x flattened and zero-padded to ``[n, r, LANES]``: one block per device, whole tiles."""
    flat = x.reshape(-1)
    rows = -(-flat.size // (n * LANES))
    return jnp.pad(flat, (0, n * rows * LANES - flat.size)).reshape(n, rows, LANES)


def _scattered(y: jax.Array, axis: Axis) -> jax.Array:
    """This device's block of Σ_X y, ``[r, LANES]`` (the reduce-scatter half, as permutes)."""
    return scatter_by_permutes(_laid(vary(y, axis), axis_size(axis)), axis)


def _gathered(block: jax.Array, like: jax.Array, axis: Axis) -> jax.Array:
    """The blocks of every device gathered, typed invariant over ``axis``, in ``like``'s shape."""
    flat = all_gather(block, axis, to="invarying").reshape(-1)
    return flat[: like.size].reshape(like.shape)


@shard_map_primitive
def all_reduce_permuted(y: jax.Array, axis: Axis) -> jax.Array:
    """``psum(y, axis)`` as permutes and an all-gather: ``y{U_X} -> y`` (typed invariant).

    y is laid out as ``[n, r, LANES]`` (zero-padded), reduce-scattered with
    ``scatter_by_permutes`` and all-gathered back: the TPU compiler runs an all-reduce
    synchronously, but a permute or an all-gather beside a matmul that does not need it.
    Cost: 2(n − 1)/n · the padded bytes. Backward: the identity (psum's), as Megatron g's."""
    return _reduced(y, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _reduced(y: jax.Array, axis: Axis) -> jax.Array:
    return _gathered(_scattered(y, axis), y, axis)


def _reduced_fwd(y: jax.Array, axis: Axis) -> tuple:
    return _reduced(y, axis), None


def _reduced_bwd(axis: Axis, _: None, ct: jax.Array) -> tuple:
    return (vary(ct, axis),)


_reduced.defvjp(_reduced_fwd, _reduced_bwd)


@shard_map_primitive
def reduced_back(x: jax.Array, axis: str) -> jax.Array:
    """Megatron f with its backward as ``all_reduce_permuted``: ``x -> x`` typed varying over
    ``axis`` (x invariant there), the cotangent ``dx{U_X}`` summed by permutes and an
    all-gather. Cost: backward 2(n − 1)/n · |dx| padded, nothing forward."""
    return _reduced_back(x, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _reduced_back(x: jax.Array, axis: str) -> jax.Array:
    return vary(x, axis)


def _reduced_back_fwd(x: jax.Array, axis: str) -> tuple:
    return vary(x, axis), None


def _reduced_back_bwd(axis: str, _: None, ct: jax.Array) -> tuple:
    return (_reduced(ct, axis),)


_reduced_back.defvjp(_reduced_back_fwd, _reduced_back_bwd)


@shard_map_primitive
def reduce_beside(y: jax.Array, beside: Any, axis: str) -> tuple[jax.Array, Any]:
    """(``all_reduce_permuted(y)``, ``beside``) with y's reduce-scatter tied to ``beside``: an
    optimization barrier releases the scattered block and ``beside`` together, so the permutes
    run while whatever computes ``beside`` (the other half-batch's column matmuls) runs, and
    the all-gather after it beside the matmuls that follow. ``beside``: a pytree of arrays
    varying over ``axis``. Backward: the identity for both (the barrier is not transposed)."""
    return _reduce_beside(y, beside, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _reduce_beside(y: jax.Array, beside: Any, axis: str) -> tuple[jax.Array, Any]:
    block = _scattered(y, axis)
    for leaf in jax.tree.leaves(beside):  # an optimization barrier takes one type
        if varying_axes(leaf) != varying_axes(block):
            raise ValueError(
                f"reduce_beside: the reduced block varies over {sorted(varying_axes(block))}, "
                f"a value beside it over {sorted(varying_axes(leaf))}; they must match."
            )
    block, beside = jax.lax.optimization_barrier((block, beside))
    return _gathered(block, y, axis), beside


def _reduce_beside_fwd(y: jax.Array, beside: Any, axis: str) -> tuple:
    return _reduce_beside(y, beside, axis), None


def _reduce_beside_bwd(axis: str, _: None, cts: tuple) -> tuple:
    ct_y, ct_beside = cts
    return vary(ct_y, axis), ct_beside


_reduce_beside.defvjp(_reduce_beside_fwd, _reduce_beside_bwd)


@jax.custom_vjp
def tied_in_backward(x: Any, other: Any) -> tuple[Any, Any]:
    """(x, other) unchanged; backward, their cotangents come out of one optimization barrier:
    whatever consumes either starts once both exist (the other half-batch's backward matmuls
    beside x's cotangent's all-reduce). Forward nothing is tied: a barrier there would order
    a scheduled program for nothing (both are computed before either is read anyway)."""
    return x, other


def _tied_fwd(x: Any, other: Any) -> tuple:
    return (x, other), None


def _tied_bwd(_: None, cts: tuple) -> tuple:
    return tuple(jax.lax.optimization_barrier(cts))


tied_in_backward.defvjp(_tied_fwd, _tied_bwd)

__all__ = [
    "ag_matmul",
    "all_reduce_permuted",
    "gather_permuted_back",
    "matmul_rs",
    "reduce_beside",
    "reduced_back",
    "scatter_by_permutes",
    "tied_in_backward",
]
