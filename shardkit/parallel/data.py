"""Data parallelism over ``data``: batch sharding, gradient sync, ZeRO-1 and FSDP (ZeRO-3).

Primitives for ``shard_map`` bodies (plus spec helpers for outside). Where each collective
comes from, for a param ``w`` used on a batch split ``x[B_data, ...]``:

* Plain DP: ``w`` is replicated, so each device's gradient is a partial sum ``dw{U_data}``.
  We make the reduction EXPLICIT: ``vary`` casts ``w`` to varying over ``data`` before the
  loss (no communication), so autodiff leaves ``dw{U_data}`` alone, and ``sync_grads``
  all-reduces it, all leaves in one bucket. (Without the cast, check_vma's implicit broadcast
  would transpose into one psum per leaf, wherever the leaf is used: the same bytes, more ops,
  and invisible in the code.)
* FSDP / ZeRO-3: ``w[D_data, ...]`` is stored split; ``fsdp_gather`` all-gathers it just before
  use (``w[D_data] -> w[D]``); autodiff transposes that all-gather into a reduce-scatter of the
  gradient (``dw{U_data} -> dw[D_data]``), so gradients arrive already split: AG + RS instead of
  an all-reduce. Under ``jax.checkpoint`` the gathered weights are not kept for backward but
  gathered again (AG + AG + RS).
* ZeRO-1: ``w`` replicated, optimizer state split; ``zero1_update`` reduce-scatters the
  gradient, updates this device's slice, and all-gathers the new params (the same bytes as one
  all-reduce).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array

from shardkit.parallel.collectives import all_gather, reduce_scatter, shard_map_primitive

Axes = tuple[str, ...]
PyTree = Any


@shard_map_primitive
def vary(tree: PyTree, axes_tree: PyTree) -> PyTree:
    """Casts each leaf to varying over its axes (identity forward; no collective in backward).

    ``axes_tree`` matches ``tree`` with a tuple of axis names per leaf (empty: leave as is).
    """
    return jax.tree.map(
        lambda x, axes: jax.lax.pcast(x, axes, to="varying") if axes else x,
        tree,
        axes_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


@shard_map_primitive
def sync_grads(grads: PyTree, axes_tree: PyTree) -> PyTree:
    """All-reduces each gradient leaf over its axes: ``dw{U_axes} -> dw``, one bucket per axes.

    Leaves that share the same reduction axes (and the same varying axes, so that a bucket
    never mixes a model-split leaf with a model-replicated one) are flattened, concatenated and
    reduced by ONE all-reduce, like DDP's gradient buckets: the count of all-reduces is the
    number of such groups, not the number of leaves. Cost: 2(n−1)/n · bucket bytes.

    Raises:
      ValueError: a leaf is typed invariant over an axis it is asked to sum (of size > 1). Its
        gradient was already reduced there (autodiff's transpose of an implicit broadcast), so
        summing again would multiply it by n: the params were not cast with ``vary`` first.
    """
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
    axes_leaves = jax.tree.leaves(axes_tree, is_leaf=lambda x: isinstance(x, tuple))
    buckets: dict[tuple[Axes, frozenset[str], jnp.dtype], list[int]] = defaultdict(list)
    for i, ((path, leaf), axes) in enumerate(zip(paths_leaves, axes_leaves, strict=True)):
        if axes:
            _check_unreduced(leaf, axes, jax.tree_util.keystr(path))
            buckets[tuple(axes), varying_axes(leaf), leaf.dtype].append(i)
    leaves = [leaf for _, leaf in paths_leaves]
    out = list(leaves)
    for (axes, _, _), members in buckets.items():
        for i, reduced in zip(
            members, _bucket_psum([leaves[i] for i in members], axes), strict=True
        ):
            out[i] = reduced
    return jax.tree.unflatten(treedef, out)


def _check_unreduced(leaf: Array, axes: Axes, path: str) -> None:
    invariant = [a for a in axes if a not in varying_axes(leaf) and jax.lax.axis_size(a) > 1]
    if invariant:
        a = invariant[0]
        raise ValueError(
            f"sync_grads: gradient leaf {path or '(root)'} is already summed over {a!r} "
            f"(typed invariant there), so all-reducing it again would multiply it by "
            f"{jax.lax.axis_size(a)}; did you forget data.vary(params, axes) before the loss?"
        )


def varying_axes(x: Array) -> frozenset[str]:
    """The mesh axes ``x`` is typed varying over (inside ``shard_map``)."""
    return frozenset(jax.typeof(x).mat.varying)


def _bucket_psum(arrays: Sequence[Array], axes: Axes) -> list[Array]:
    flat = jnp.concatenate([a.reshape(-1) for a in arrays])
    # DP gradient sync: one all-reduce for every leaf that is a partial sum over these axes.
    flat = jax.lax.psum(flat, axes)
    sizes = [a.size for a in arrays]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [flat[o : o + a.size].reshape(a.shape) for o, a in zip(offsets, arrays, strict=True)]


@shard_map_primitive
def fsdp_gather(
    tree: PyTree, dims_tree: PyTree, axis: str = "data", *, bucket: bool = True
) -> PyTree:
    """All-gathers each FSDP-split leaf along its split dim: ``w[D_data] -> w[D]``.

    ``dims_tree`` matches ``tree`` with the split dim of each leaf, or None for leaves that are
    not split. With ``bucket`` (the default) the split leaves travel as ONE flat buffer per
    group of leaves sharing a dtype and varying axes (FSDP2's and DDP's buckets): each
    fragment is flattened with its split dim first, the concatenation is all-gathered once,
    and every leaf is cut back out of the gathered [n, Σ] buffer. Backward: one reduce-scatter
    per bucket (the transpose). Leaves with different varying axes never share a buffer: a
    concatenation would cast the invariant ones, and its transpose would all-reduce their
    cotangents. ``bucket=False`` gathers leaf by leaf (same bytes, one op per leaf).
    Cost: (n−1)/n · the gathered bytes forward, the same backward.
    """
    leaves, treedef = jax.tree.flatten(tree)
    dims = jax.tree.leaves(dims_tree, is_leaf=lambda x: x is None)
    if len(dims) != len(leaves):
        raise ValueError(f"dims_tree has {len(dims)} leaves, the params {len(leaves)}.")
    out = list(leaves)
    if not bucket:
        for i, (x, dim) in enumerate(zip(leaves, dims, strict=True)):
            if dim is not None:  # FSDP: materialise the whole weight just before it is used.
                out[i] = all_gather(x, axis, axis_dim=dim, tiled=True)
        return jax.tree.unflatten(treedef, out)
    groups: dict[tuple[Any, frozenset[str]], list[int]] = defaultdict(list)
    for i, (x, dim) in enumerate(zip(leaves, dims, strict=True)):
        if dim is not None:
            groups[(x.dtype, varying_axes(x))].append(i)
    for members in groups.values():
        flat = [jnp.moveaxis(leaves[i], dims[i], 0).reshape(-1) for i in members]
        gathered = all_gather(jnp.concatenate(flat), axis)  # [n, Σ sizes]
        offset = 0
        for i, piece in zip(members, flat, strict=True):
            x, dim = leaves[i], dims[i]
            moved = jnp.moveaxis(x, dim, 0).shape
            block = gathered[:, offset : offset + piece.size].reshape(-1, *moved[1:])
            out[i] = jnp.moveaxis(block, 0, dim)  # device-major blocks along the split dim
            offset += piece.size
    return jax.tree.unflatten(treedef, out)


@shard_map_primitive
def zero1_update(
    optimizer: optax.GradientTransformation,
    grads: PyTree,
    opt_state_frag: Any,
    params: PyTree,
    dims_tree: PyTree,
    axis: str = "data",
) -> tuple[PyTree, Any]:
    """ZeRO-1 step inside ``shard_map``: optimizer state split over ``axis``, params replicated.

    ``dw{U_data} --ReduceScatter--> dw[D_data]``; update the local slice with the local state
    ``state[D_data]``; ``w[D_data] --AllGather--> w[D]``. Leaves whose dim is None are
    all-reduced and updated whole (their state is replicated).

    Args:
      optimizer: an elementwise optax transformation (e.g. AdamW; no global norms).
      grads: per-device partial gradients (varying over ``axis``), like ``params``.
      opt_state_frag: this device's optimizer-state slice, split like ``dims_tree``.
      params: replicated params.
      dims_tree: the split dim of each leaf (or None).
    """
    n = jax.lax.axis_size(axis)
    idx = jax.lax.axis_index(axis)

    def local_grad(g: Array, dim: int | None) -> Array:
        if dim is None:
            return jax.lax.psum(g, axis)
        # ZeRO-1: each device only needs the summed gradient of the slice it updates.
        return reduce_scatter(g, axis, scatter_dim=dim, tiled=True)

    def local_param(w: Array, dim: int | None) -> Array:
        if dim is None:
            return w
        size = w.shape[dim] // n
        return jax.lax.dynamic_slice_in_dim(
            jax.lax.pcast(w, axis, to="varying"), idx * size, size, dim
        )

    is_none = lambda x: x is None  # noqa: E731
    g_frag = jax.tree.map(local_grad, grads, dims_tree, is_leaf=is_none)
    w_frag = jax.tree.map(local_param, params, dims_tree, is_leaf=is_none)
    w_frag, opt_state_frag = optax_update(optimizer, g_frag, opt_state_frag, w_frag)
    gather = functools.partial(gather_invariant, axis=axis)
    return jax.tree.map(gather, w_frag, dims_tree, is_leaf=is_none), opt_state_frag


def optax_update(
    optimizer: optax.GradientTransformation, grads: PyTree, opt_state: Any, params: PyTree
) -> tuple[PyTree, Any]:
    """One optax update, under "standard" dtype promotion (optax mixes Python floats with int32
    step counts, which strict promotion rejects)."""
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state


@shard_map_primitive
def gather_invariant(x: Array, dim: int | None, axis: str = "data") -> Array:
    """All-gather typed invariant (every device provably holds the same result) for ZeRO-1."""
    # ZeRO-1: reassemble the updated params from every device's slice.
    return x if dim is None else jax.lax.all_gather(x, axis, axis=dim, tiled=True, to="invarying")


@shard_map_primitive
def global_norm(grads: PyTree, split_axes_tree: PyTree, axes: Axes) -> Array:
    """The L2 norm of a whole gradient pytree held as shards: ``sqrt(Σ_leaves ‖g‖²)``.

    Args:
      grads: synced gradients (no pending ``{U}`` partial sums), each leaf split over its
        ``split_axes_tree`` entry and identical on the other devices of ``axes``.
      split_axes_tree: matches ``grads``: per leaf, the mesh axes it is SPLIT over (a tuple).
      axes: every mesh axis of the group the norm is over (those of size > 1).

    One scalar all-reduce over ``axes``, 2(n−1)/n · 4 bytes: each device adds the squares of
    its shards, each divided by the number of devices in ``axes`` that hold the same shard (a
    leaf whole on every device counts once, not n times), and the psum adds the rest. It reads
    every synced leaf, so it runs after the step's gradient sync and XLA cannot merge it with
    those all-reduces. Result: float32, invariant over ``axes``.
    """
    leaves = jax.tree.leaves(grads)
    splits = jax.tree.leaves(split_axes_tree, is_leaf=lambda x: isinstance(x, tuple))
    sizes = {a: jax.lax.axis_size(a) for a in axes}
    local = jnp.zeros((), jnp.float32)
    for leaf, split in zip(leaves, splits, strict=True):
        copies = math.prod(n for a, n in sizes.items() if a not in split)
        local = local + jnp.sum(jnp.square(leaf.astype(jnp.float32))) / copies
    if not axes:
        return jnp.sqrt(local)
    # ‖g‖²{U_axes} -> ‖g‖²: add the squares of the shards the other devices hold.
    missing = tuple(a for a in axes if a not in varying_axes(local))
    local = jax.lax.pcast(local, missing, to="varying") if missing else local
    return jnp.sqrt(jax.lax.psum(local, tuple(axes)))


def clip_by_norm(grads: PyTree, norm: Array, max_norm: float) -> PyTree:
    """``grads · max_norm / norm`` where ``norm ≥ max_norm``: optax.clip_by_global_norm's rule,
    with the norm given (``global_norm`` of the shards). Elementwise: no communication."""
    keep = norm < max_norm
    return jax.tree.map(
        lambda g: jax.lax.select(keep, g, (g / norm.astype(g.dtype)) * max_norm), grads
    )
