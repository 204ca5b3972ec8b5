"""Collectives for ``jax.shard_map`` bodies: documented wrappers, ring versions, Megatron f/g.

Every function here runs inside a ``shard_map`` body with ``check_vma=True``.

Conventions
  ``axis``: one mesh axis name (``"model"``) or a tuple of names (``("data", "model")``). With
  a tuple, devices are numbered by their linear index over those axes in the order given, as
  ``axis_index`` and ``all_gather`` number them; ``n`` is the product of the sizes. (In jax
  0.10.2 a bare ``jax.lax.ppermute`` numbers them in mesh order instead, whatever the tuple's
  order; ``permute`` and the rings translate, so all functions here agree.) Dims may be
  negative.

  Sharding signatures use the scaling book's notation: ``x[I_X, J]`` is split along I over mesh
  axis X (each device holds one block of I), ``x[I, J]`` is whole on every device of X, and
  ``{U_X}`` marks an unreduced partial sum over X (each device holds one summand). AllGather
  removes a subscript, ReduceScatter turns ``{U_X}`` into a subscript, AllReduce removes
  ``{U_X}``, AllToAll moves a subscript from one dim to another.

  Costs are bytes SENT per device by a ring over n devices (DESIGN.md's table), V as named.

  vma typing: under ``check_vma`` a value is *varying* over X when devices of X may hold
  different values and *invariant* when they provably hold the same. ``psum`` maps varying to
  invariant (so ``out_specs`` may omit X); ``all_gather``, ``psum_scatter``, ``all_to_all`` and
  ``ppermute`` map varying to varying. An invariant input is first cast to varying, as the
  built-ins do (so ``psum`` of an invariant x is ``n * x``). The transpose of that cast is a
  ``psum``: that is where gradient all-reduces come from (see ``megatron_f``).

Ring versions (``ring_*``, ``bidir_*``) use only ``ppermute`` plus local slicing, updates and
adds, so every byte they move is visible as a collective-permute in the HLO. They unroll a
static Python loop of n - 1 steps rather than a ``fori_loop``: n is a static mesh size, every
permute then appears (and is scheduled) individually in the compiled HLO instead of once inside
a ``while`` the ledger would have to multiply by its trip count, and no loop carry needs a
hand-maintained vma type. Compile time grows linearly in n, which is fine for mesh axes.
Autodiff transposes each ``ppermute`` into the reverse ``ppermute``, so their gradients are the
built-ins' with no custom rule: the transpose of a ring all-gather is a ring reduce-scatter in
the opposite direction, and vice versa.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp

from shardkit.parallel.vma import (
    Axis,
    OutsideShardMapError,
    names,
    shard_map_primitive,
    vary,
    varying_axes,
)

__all__ = [
    "OutsideShardMapError",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "axis_index",
    "axis_size",
    "bidir_all_gather",
    "bidir_all_reduce",
    "bidir_reduce_scatter",
    "halving_reduce_scatter",
    "megatron_f",
    "megatron_g",
    "permute",
    "reduce_scatter",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_shift",
    "shard_map_primitive",
]


# ---------------------------------------------------------------------------------------------
# Thin wrappers over the built-ins.


@shard_map_primitive
def axis_index(axis: Axis) -> jax.Array:
    """This device's index along ``axis`` (int32 scalar in ``[0, n)``, varying over ``axis``)."""
    return jax.lax.axis_index(axis)


@shard_map_primitive
def axis_size(axis: Axis) -> int:
    """The number of devices n along ``axis`` (a static Python int)."""
    return jax.lax.axis_size(axis)


@shard_map_primitive
def all_reduce(x: jax.Array, axis: Axis) -> jax.Array:
    """Sums x over ``axis`` (``psum``): ``x[I]{U_X} -> x[I]``.

    The result is typed invariant over X. Ring cost: 2(n-1)/n · V for x of V bytes (a
    reduce-scatter then an all-gather). Backward: identity (the transpose of ``psum``).
    """
    return jax.lax.psum(x, axis)


@shard_map_primitive
def all_gather(
    x: jax.Array, axis: Axis, *, axis_dim: int = 0, tiled: bool = False, to: str = "varying"
) -> jax.Array:
    """Gathers the blocks of x from every device of ``axis``: ``x[I_X, J] -> x[I, J]``.

    Args:
      x: this device's block.
      axis: the mesh axis (or axes) to gather over.
      axis_dim: with ``tiled``, the dim the blocks are concatenated along; without, where a new
        dim of size n is inserted (blocks stacked in device order).
      tiled: concatenate instead of stack.
      to: the result's type over X: "varying" (like its input; backward a reduce-scatter of
        the cotangent), or "invarying" (every device provably holds the same result, as after
        ZeRO's update; it then leaves ``shard_map`` replicated over X).

    Ring cost: (n-1)/n · V for an output of V bytes.
    """
    return jax.lax.all_gather(x, axis, axis=axis_dim, tiled=tiled, to=to)


@shard_map_primitive
def reduce_scatter(
    x: jax.Array, axis: Axis, *, scatter_dim: int = 0, tiled: bool = False
) -> jax.Array:
    """Sums x over ``axis`` and keeps this device's block (``psum_scatter``): ``x[I, J]{U_X} ->
    x[I_X, J]``.

    Args:
      x: this device's summand; ``x.shape[scatter_dim]`` divisible by n (equal to n untiled).
      axis: the mesh axis (or axes) to reduce over.
      scatter_dim: the dim split into n blocks; device k keeps block k.
      tiled: keep the block's dim (size/n); untiled, dim ``scatter_dim`` (size n) is removed.

    Ring cost: (n-1)/n · V for an input of V bytes. Backward: an all-gather of the cotangent.
    """
    # psum_scatter does not accept a negative scatter_dimension (jax 0.10.2).
    dim = scatter_dim % x.ndim
    n, size = axis_size(axis), x.shape[dim]
    if (size % n if tiled else size != n) and n > 1:
        need = "divisible by" if tiled else "equal to"
        raise ValueError(
            f"reduce_scatter over {axis!r}: dim {dim} has size {size}, not {need} the {n} devices "
            "it is split over (pad it first; Megatron-SP pads tokens to a multiple of the token "
            "shards)."
        )
    return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=tiled)


@shard_map_primitive
def all_to_all(
    x: jax.Array, axis: Axis, split_axis: int, concat_axis: int, *, tiled: bool = False
) -> jax.Array:
    """Resplits x: ``x[I, J_X] -> x[I_X, J]`` with I at ``split_axis`` and J at ``concat_axis``.

    Dim ``split_axis`` is cut into n blocks, block k goes to device k, and the received blocks
    are concatenated (``tiled``) or stacked (untiled; ``x.shape[split_axis]`` must equal n)
    along ``concat_axis`` in device order. ``all_to_all(y, axis, concat_axis, split_axis)``
    undoes it. Cost: (n-1)/n · V for V local bytes. Backward: the inverse all-to-all.
    """
    return jax.lax.all_to_all(x, axis, split_axis % x.ndim, concat_axis % x.ndim, tiled=tiled)


@shard_map_primitive
def permute(x: jax.Array, axis: Axis, perm: Sequence[tuple[int, int]]) -> jax.Array:
    """Sends x from device ``src`` to device ``dst`` for each ``(src, dst)`` in ``perm``.

    ``x[I_X] -> x[I_X]`` with the blocks moved between devices; a device that receives nothing
    gets zeros. Indices are ``axis_index`` numbers. Cost: V (all of x) per sending device.
    Backward: the inverse permutation.
    """
    to_mesh = _mesh_order_index(axis)
    return jax.lax.ppermute(x, axis, [(to_mesh[s], to_mesh[d]) for s, d in perm])


@shard_map_primitive
def ring_shift(x: jax.Array, axis: Axis, offset: int = 1) -> jax.Array:
    """Sends x from device i to device (i + offset) mod n: ``x[I_X] -> x[I_X]``, blocks rotated.

    Cost: V (all of x) per device. Backward: the shift by ``-offset``.
    """
    return permute(x, axis, _ring_perm(axis_size(axis), offset))


# ---------------------------------------------------------------------------------------------
# Ring versions built only from ppermute.


@shard_map_primitive
def ring_all_gather(
    x: jax.Array, axis: Axis, *, axis_dim: int = 0, tiled: bool = False
) -> jax.Array:
    """``all_gather`` as n-1 ring steps (device i -> i+1): ``x[I_X, J] -> x[I, J]``.

    Same arguments, result and vma type (varying over X) as ``all_gather``. Each step forwards
    the block received last, so every device sends (n-1)/n · V for an output of V bytes; one
    link direction carries it all.
    """
    x, dim = _as_tiled(x, axis_dim, tiled)
    return _ring_gather(x, axis, dim, 1)


@shard_map_primitive
def ring_reduce_scatter(
    x: jax.Array, axis: Axis, *, scatter_dim: int = 0, tiled: bool = False
) -> jax.Array:
    """``reduce_scatter`` as n-1 ring steps: ``x[I, J]{U_X} -> x[I_X, J]``.

    Same arguments, result and vma type as ``reduce_scatter``. A partial sum of each block
    travels the ring, each device adding its summand, and ends on the block's owner: every device
    sends (n-1)/n · V for an input of V bytes.
    """
    dim = _check_scatter(x, axis, scatter_dim, tiled)
    out = _ring_scatter(x, axis, dim, 1)
    return out if tiled else jnp.squeeze(out, dim)


@shard_map_primitive
def halving_reduce_scatter(x: jax.Array, axis: Axis) -> jax.Array:
    """``reduce_scatter`` by recursive halving: ``x[n, ...]{U_X} -> x[...]`` (untiled: device
    k keeps the sum of block k), n a power of two.

    log2(n) ``ppermute`` exchanges instead of a ring's n − 1: at distance d = n/2, …, 1 each
    device keeps the half of its remaining blocks that holds its own index, sends the other
    half to device i XOR d and adds the half it receives. Each device sends (n/2 + … + 1)
    blocks, (n−1)/n · V for an input of V bytes, exactly a ring's; with fewer, larger steps
    a scheduler hides each under fewer matmuls.
    """
    n, i = axis_size(axis), axis_index(axis)
    if n & (n - 1) or x.shape[0] != n:
        raise ValueError(
            f"halving_reduce_scatter over {axis!r} needs a power-of-two axis and dim 0 equal "
            f"to it, got {n} devices and dim 0 of {x.shape[0]}."
        )
    x = vary(x, axis)
    d = n // 2
    while d:
        # x holds the 2d blocks whose index matches device i above bit d: keep i's half.
        mine = (i // d) % 2
        keep = jax.lax.dynamic_slice_in_dim(x, mine * d, d, 0)
        send = jax.lax.dynamic_slice_in_dim(x, (1 - mine) * d, d, 0)
        x = keep + permute(send, axis, [(j, j ^ d) for j in range(n)])
        d //= 2
    return x[0]


@shard_map_primitive
def ring_all_reduce(
    x: jax.Array, axis: Axis, *, to: Literal["varying", "invariant"] = "varying"
) -> jax.Array:
    """``all_reduce`` as a ring reduce-scatter then a ring all-gather: ``x[I]{U_X} -> x[I]``.

    x of any shape is flattened and zero-padded to a multiple of n. Cost: 2(n-1)/n · V.

    vma typing: with ``to="varying"`` (all ppermute) the result is numerically the same on every
    device but typed *varying* over X, because no ppermute can prove invariance. Gradients stay
    exact under that honest typing (its transpose is again a ring all-reduce), but a loss built
    from it counts once per device, and ``out_specs`` must keep X. ``to="invariant"`` gives what
    ``psum`` gives: the all-gather half is the built-in ``all_gather(..., to="invarying")`` (the
    same (n-1)/n · V bytes), the result is typed invariant, and backward is the identity, as for
    ``psum``. JAX has no free varying-to-invariant cast; this is the cheapest sound one.
    """
    return _all_reduce_by(x, axis, ring_reduce_scatter, ring_all_gather, to)


@shard_map_primitive
def bidir_all_gather(
    x: jax.Array, axis: Axis, *, axis_dim: int = 0, tiled: bool = False
) -> jax.Array:
    """``all_gather`` as two concurrent rings: ``x[I_X, J] -> x[I, J]``.

    The first half of each (flattened) block goes clockwise (i -> i+1), the second half
    counter-clockwise, so each link direction carries half the data: the same (n-1)/n · V sent
    per device as ``ring_all_gather``, in about half the time on full-duplex links.
    """
    row = x.reshape(1, -1)
    half = row.shape[1] // 2
    if half == 0:  # a one-element block cannot be halved
        rows = _ring_gather(row, axis, 0, 1)
    else:
        clockwise = _ring_gather(row[:, :half], axis, 0, 1)
        rows = jnp.concatenate([clockwise, _ring_gather(row[:, half:], axis, 0, -1)], axis=1)
    return _place_blocks(rows.reshape(-1, *x.shape), axis_dim, tiled)


@shard_map_primitive
def bidir_reduce_scatter(
    x: jax.Array, axis: Axis, *, scatter_dim: int = 0, tiled: bool = False
) -> jax.Array:
    """``reduce_scatter`` as two concurrent rings: ``x[I, J]{U_X} -> x[I_X, J]``.

    The first half of every (flattened) block is reduced clockwise and the second half
    counter-clockwise: (n-1)/n · V sent per device, half on each link direction.
    """
    dim = _check_scatter(x, axis, scatter_dim, tiled)
    blocks = _take_blocks(x, dim, axis_size(axis), tiled)
    rows = blocks.reshape(blocks.shape[0], -1)
    half = rows.shape[1] // 2
    if half == 0:  # one-element blocks cannot be halved
        row = _ring_scatter(rows, axis, 0, 1)
    else:
        clockwise = _ring_scatter(rows[:, :half], axis, 0, 1)
        row = jnp.concatenate([clockwise, _ring_scatter(rows[:, half:], axis, 0, -1)], axis=1)
    return row.reshape(blocks.shape[1:])


@shard_map_primitive
def bidir_all_reduce(
    x: jax.Array, axis: Axis, *, to: Literal["varying", "invariant"] = "varying"
) -> jax.Array:
    """``all_reduce`` as a bidirectional reduce-scatter then all-gather: ``x[I]{U_X} -> x[I]``.

    Cost: 2(n-1)/n · V per device, half on each link direction. ``to`` as in
    ``ring_all_reduce`` (with ``"invariant"`` the all-gather half is the built-in one).
    """
    return _all_reduce_by(x, axis, bidir_reduce_scatter, bidir_all_gather, to)


# ---------------------------------------------------------------------------------------------
# Megatron's conjugate pair.


@shard_map_primitive
def megatron_f(x: jax.Array, axis: Axis) -> jax.Array:
    """Megatron's f: identity forward, all-reduce of the cotangent backward.

    ``x[B, D] -> x[B, D]``: an x invariant over X comes back typed varying over X (no
    communication); backward, the cotangent ``dx[B, D]{U_X}`` is psummed. Put it before a
    column-parallel matmul ``x[B, D] · W[D, F_X] -> h[B, F_X]``, whose per-device cotangent
    of x is a partial sum.

    Why explicit: autodiff does not merge reductions. An invariant activation that feeds three
    column-parallel matmuls (separate q, k, v) is cast to varying once per use, so backward
    runs three all-reduces, one per cotangent. One f before the three sums their cotangents
    locally first and all-reduces once: a third of the bytes.

    Raises ValueError if x is already varying over an axis of size > 1.
    """
    _require(x, axis, varying=False, name="megatron_f")
    return vary(x, axis)  # pcast(x, axis, to="varying") of the axes x is invariant over


@shard_map_primitive
def megatron_g(x: jax.Array, axis: Axis) -> jax.Array:
    """Megatron's g: all-reduce forward, identity backward.

    ``y[B, D]{U_X} -> y[B, D]``: psums the partial sums of a varying x into a value typed
    invariant over X (cost 2(n-1)/n · V); backward passes the invariant cotangent to every
    device unchanged. Put it after a row-parallel matmul ``h[B, F_X] · W[F_X, D] -> y[B,
    D]{U_X}``. Raises ValueError if x is invariant over an axis of size > 1 (its psum would be
    n · x, not a sum of partials).
    """
    _require(x, axis, varying=True, name="megatron_g")
    return jax.lax.psum(x, axis)


# ---------------------------------------------------------------------------------------------
# Helpers.


def _require(x: jax.Array, axis: Axis, *, varying: bool, name: str) -> None:
    """Raises unless x is varying (or invariant) over each axis of ``axis`` larger than 1."""
    wrong = [a for a in names(axis) if (a in varying_axes(x)) != varying and axis_size(a) > 1]
    if wrong:
        state = "invariant" if varying else "varying"
        need = "a varying partial sum" if varying else "an invariant value"
        raise ValueError(f"{name} needs {need} over {wrong[0]!r}, but x is {state} there.")


def _ring_perm(n: int, offset: int) -> list[tuple[int, int]]:
    return [(i, (i + offset) % n) for i in range(n)]


def _mesh_order_index(axis: Axis) -> list[int]:
    """Maps each ``axis_index`` number to ppermute's number for the same device.

    ppermute numbers the devices of a tuple of axes in mesh order, not the tuple's order.
    """
    axes = names(axis)
    mesh_names = [a for a in jax.sharding.get_abstract_mesh().axis_names if a in axes]
    if len(axes) == 1 or len(mesh_names) != len(axes):  # one axis, or not mesh axes (vmap)
        return list(range(axis_size(axis)))
    sizes = [axis_size(a) for a in axes]
    coords = itertools.product(*(range(k) for k in sizes))  # in axis_index order
    return [_linear(dict(zip(axes, c, strict=True)), mesh_names) for c in coords]


def _linear(coord: dict[str, int], names: Sequence[str]) -> int:
    index = 0
    for name in names:
        index = index * axis_size(name) + coord[name]
    return index


def _as_tiled(x: jax.Array, axis_dim: int, tiled: bool) -> tuple[jax.Array, int]:
    """Untiled gathers stack along a new dim: insert it and gather tiled along it."""
    if tiled:
        return x, axis_dim % x.ndim
    dim = axis_dim % (x.ndim + 1)
    return jnp.expand_dims(x, dim), dim


def _check_scatter(x: jax.Array, axis: Axis, scatter_dim: int, tiled: bool) -> int:
    dim, n = scatter_dim % x.ndim, axis_size(axis)
    size = x.shape[dim]
    if (size % n) if tiled else (size != n):
        need = "divisible by" if tiled else "equal to"
        raise ValueError(f"reduce-scatter over {axis!r} needs dim {dim} ({size}) {need} {n}.")
    return dim


def _ring_gather(x: jax.Array, axis: Axis, dim: int, step: int) -> jax.Array:
    """Tiled all-gather along ``dim``, each step passing blocks from device i to i + step."""
    n, i, rows = axis_size(axis), axis_index(axis), x.shape[dim]
    block = vary(x, axis)
    shape = list(x.shape)
    shape[dim] *= n
    out = jnp.zeros(shape, x.dtype)
    for s in range(n):
        if s:
            block = ring_shift(block, axis, step)
        # After s hops the block is the one that started on device i - s·step.
        out = jax.lax.dynamic_update_slice_in_dim(out, block, (i - s * step) % n * rows, dim)
    return out


def _ring_scatter(x: jax.Array, axis: Axis, dim: int, step: int) -> jax.Array:
    """Tiled reduce-scatter along ``dim``, each step passing sums from device i to i + step."""
    n, i = axis_size(axis), axis_index(axis)
    rows = x.shape[dim] // n
    x = vary(x, axis)

    def block(k: jax.Array) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(x, k % n * rows, rows, dim)

    # The sum for block k starts on device k + step and reaches device k after n - 1 hops.
    acc = block(i - step)
    for s in range(1, n):
        acc = ring_shift(acc, axis, step) + block(i - (s + 1) * step)
    return acc


def _place_blocks(blocks: jax.Array, axis_dim: int, tiled: bool) -> jax.Array:
    """``[n, *block]`` in device order -> stacked at ``axis_dim`` or concatenated along it."""
    if not tiled:
        return jnp.moveaxis(blocks, 0, axis_dim % blocks.ndim)
    dim = axis_dim % (blocks.ndim - 1)
    moved = jnp.moveaxis(blocks, 0, dim)  # [..., n, rows, ...]
    return moved.reshape((*moved.shape[:dim], -1, *moved.shape[dim + 2 :]))


def _take_blocks(x: jax.Array, dim: int, n: int, tiled: bool) -> jax.Array:
    """Inverse of ``_place_blocks``: the n blocks of x along ``dim`` as ``[n, *block]``."""
    if tiled:
        x = x.reshape((*x.shape[:dim], n, x.shape[dim] // n, *x.shape[dim + 1 :]))
    return jnp.moveaxis(x, dim, 0)


Scatter = Callable[..., jax.Array]


def _all_reduce_by(
    x: jax.Array, axis: Axis, scatter: Scatter, gather: Scatter, to: str
) -> jax.Array:
    """All-reduce as ``scatter`` then ``gather`` on x flattened and padded to a multiple of n."""
    if to not in ("varying", "invariant"):
        raise ValueError(f"to must be 'varying' or 'invariant', got {to!r}.")
    x = vary(x, axis)
    if to == "invariant":
        return _scatter_then_invariant_gather(x, axis, scatter)
    return _unflatten(gather(scatter(_flat(x, axis), axis, tiled=True), axis, tiled=True), x)


def _flat(x: jax.Array, axis: Axis) -> jax.Array:
    flat = x.reshape(-1)
    return jnp.pad(flat, (0, -flat.size % axis_size(axis)))


def _unflatten(flat: jax.Array, like: jax.Array) -> jax.Array:
    return flat[: like.size].reshape(like.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _scatter_then_invariant_gather(x: jax.Array, axis: Axis, scatter: Scatter) -> jax.Array:
    part = scatter(_flat(x, axis), axis, tiled=True)
    return _unflatten(jax.lax.all_gather(part, axis, tiled=True, to="invarying"), x)


def _invariant_fwd(x: jax.Array, axis: Axis, scatter: Scatter) -> tuple[jax.Array, None]:
    return _scatter_then_invariant_gather(x, axis, scatter), None


def _invariant_bwd(axis: Axis, scatter: Scatter, _: None, ct: jax.Array) -> tuple[jax.Array]:
    # psum's transpose: every device's summand gets the whole (invariant) cotangent.
    return (vary(ct, axis),)


_scatter_then_invariant_gather.defvjp(_invariant_fwd, _invariant_bwd)
