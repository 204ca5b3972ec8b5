"""Data parallelism over ``data``: batch sharding, gradient sync, ZeRO-1/2 and FSDP (ZeRO-3).

Primitives for ``shard_map`` bodies (plus spec helpers for outside). Where each collective
comes from, for a param ``w`` used on a batch split ``x[B_data, ...]``:

* Plain DP: ``w`` is replicated, so each device's gradient is a partial sum ``dw{U_data}``.
  We make the reduction EXPLICIT: ``vary`` casts ``w`` to varying over ``data`` before the
  loss (no communication), so autodiff leaves ``dw{U_data}`` alone, and ``sync_grads``
  all-reduces it, all leaves in one bucket. (Without the cast, check_vma's implicit broadcast
  would transpose into one psum per leaf, wherever the leaf is used: the same bytes, more ops,
  and invisible in the code.) Overlapped (``sync_in_backward`` through ``prefetch_layers``):
  each layer's gradients all-reduced in the next layer's backward step instead.
* FSDP / ZeRO-3: ``w[D_data, ...]`` is stored split; ``fsdp_gather`` all-gathers it just before
  use (``w[D_data] -> w[D]``); autodiff transposes that all-gather into a reduce-scatter of the
  gradient (``dw{U_data} -> dw[D_data]``), so gradients arrive already split: AG + RS instead of
  an all-reduce. Under ``jax.checkpoint`` the gathered weights are not kept for backward but
  gathered again (AG + AG + RS). ``prefetch_layers`` runs a stack of layers with each layer's
  gather issued one layer ahead, beside the previous layer's compute.
* ZeRO-1: ``w`` replicated, optimizer state split; ``zero_scatter`` reduce-scatters the
  gradients once backward is done, ``zero_update`` updates this device's slice and all-gathers
  the new params (the same bytes as one all-reduce; ``zero1_update`` is both).
* ZeRO-2: as ZeRO-1, but ``zero_attach`` reduce-scatters each gradient where backward makes it
  (per layer inside a scan), so the gradients are never all whole at once.

Outside ``shard_map``: ``opt_state_specs`` / ``opt_state_layout`` lay an optax state out like
its params (param-shaped leaves split as their param, step counts replicated).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from shardkit.parallel.collectives import all_gather, reduce_scatter
from shardkit.parallel.overlap import all_reduce_permuted, gather_permuted_back, scatter_by_permutes
from shardkit.parallel.tiles import Tiles, wire
from shardkit.parallel.vma import shard_map_primitive, varying_axes
from shardkit.parallel.vma import vary as vary_leaf

Axes = tuple[str, ...]
PyTree = Any


@shard_map_primitive
def vary(tree: PyTree, axes_tree: PyTree) -> PyTree:
    """Casts each leaf to varying over its axes (identity forward; no collective in backward).

    ``axes_tree`` matches ``tree`` with a tuple of axis names per leaf (empty: leave as is).
    """
    return jax.tree.map(vary_leaf, tree, axes_tree, is_leaf=lambda x: isinstance(x, tuple))


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


def accumulate(
    value_and_grad: Callable[..., tuple[Any, PyTree]],
    primals: PyTree,
    batch: Sequence[Array],
    micro: int,
) -> tuple[Any, PyTree]:
    """Gradient accumulation: ``value_and_grad(primals, *batch)`` over ``micro`` micro-batches
    of the local batch, one after another (``lax.scan``), values and gradients averaged.

    Every ``batch`` input is split along dim 0 into [M, b/M, ...]; micro-batch m holds local
    examples m·b/M … (m+1)·b/M − 1. Each micro-batch's loss is computed as if it were the
    batch (a mean over it), so the average over the M micro-batches is the batch's mean: the
    same value and gradients as one pass, up to float summation order, with one micro-batch's
    activations live at a time and one gradient-sized float32 sum carried. Collectives inside
    ``value_and_grad`` (a model's activation all-reduces, an FSDP gather) run once per
    micro-batch; sync the returned gradients once, after it. ``micro=1``: one plain call.

    Raises:
      ValueError: the local batch is not divisible by ``micro``.
    """
    if micro == 1:
        return value_and_grad(primals, *batch)
    rows = {x.shape[0] for x in batch}
    if any(n % micro for n in rows):
        raise ValueError(
            f"The local batch ({', '.join(map(str, sorted(rows)))}) is not divisible by "
            f"{micro} micro-batches."
        )
    split = tuple(x.reshape(micro, x.shape[0] // micro, *x.shape[1:]) for x in batch)
    # The sum starts typed as the gradients will be: each varies like its primal.
    zeros = jax.tree.map(lambda p: vary_leaf(jnp.zeros_like(p), varying_axes(p)), primals)

    def one(total: PyTree, micro_batch: tuple[Array, ...]) -> tuple[PyTree, Any]:
        value, grads = value_and_grad(primals, *micro_batch)
        return jax.tree.map(jnp.add, total, grads), value

    total, values = jax.lax.scan(one, zeros, split)
    averaged = jax.tree.map(lambda v: v.sum(0) / micro, values)
    return averaged, jax.tree.map(lambda g: g / micro, total)


def narrowed(grads: PyTree, dtype: str) -> PyTree:
    """``grads`` for a gradient sync in ``dtype``: float leaves wider than it cast to it.

    "bfloat16" is what XLA's partitioner sends a bf16 model's gradients in: half the bytes of
    a float32 all-reduce on a TPU, each device's partial gradient rounded to bf16 first (the
    loss and the ZeRO / FSDP reduce-scatters are not passed here: they stay float32). XLA:CPU
    widens a bf16 all-reduce to float32: on CPU only the rounding differs. Undo with
    ``cast_like`` after ``sync_grads``."""
    to = jnp.dtype(dtype)
    wider = lambda x: jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > to.itemsize  # noqa: E731
    return jax.tree.map(lambda x: x.astype(to) if wider(x) else x, grads)


def cast_like(tree: PyTree, like: PyTree) -> PyTree:
    """Each leaf of ``tree`` in the dtype of ``like``'s (``narrowed`` undone)."""
    return jax.tree.map(lambda x, y: x.astype(y.dtype), tree, like)


def _check_unreduced(leaf: Array, axes: Axes, path: str) -> None:
    invariant = [a for a in axes if a not in varying_axes(leaf) and jax.lax.axis_size(a) > 1]
    if invariant:
        a = invariant[0]
        raise ValueError(
            f"sync_grads: gradient leaf {path or '(root)'} is already summed over {a!r} "
            f"(typed invariant there), so all-reducing it again would multiply it by "
            f"{jax.lax.axis_size(a)}; did you forget data.vary(params, axes) before the loss?"
        )


def _bucket_psum(arrays: Sequence[Array], axes: Axes) -> list[Array]:
    flat = jnp.concatenate([a.reshape(-1) for a in arrays])
    # DP gradient sync: one all-reduce for every leaf that is a partial sum over these axes.
    flat = jax.lax.psum(flat, axes)
    sizes = [a.size for a in arrays]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [flat[o : o + a.size].reshape(a.shape) for o, a in zip(offsets, arrays, strict=True)]


def prefetch_layers(
    block: Callable[[Array, PyTree], Array],
    fetch: Callable[[PyTree], PyTree],
    x: Array,
    stacked: PyTree,
    layers: str = "scan",
) -> Array:
    """``x = block(x, fetch(layer_i))`` over the leading axis of ``stacked`` (or its list of
    layers: ``layers="list"``), each layer's ``fetch`` issued one layer ahead: while layer i
    runs, layer i + 1's is already under way (it depends on nothing layer i computes), so a
    scheduler with asynchronous collectives runs it beside layer i's matmuls. Layer 0's is
    fetched before the loop; a ``lax.scan`` (``layers="scan"``) carries it, or a loop unrolls.

    Backward (autodiff of the same loop): the transpose of layer i + 1's fetch sits in layer
    i's backward step, beside layer i's backward matmuls, and it depends on nothing they
    compute. Two fetches use it:
      FSDP's gather (``fsdp_gather``): the all-gather one layer ahead; its transpose, the
        gradient's reduce-scatter (with ``permuted_back``, of permutes), one layer behind.
      DP's gradient sync (``sync_in_backward``): a cast forward; the layer's gradient
        all-reduce one layer behind, under the next layer's backward.
    Bytes: one fetch per layer, as fetching in each layer's own step. Memory: one more fetched
    layer held than the plain loop. Under ``jax.checkpoint`` the fetched layer would be a saved
    input, not fetched again: use it without remat.
    """
    listed = layers == "list"
    count = len(stacked) if listed else jax.tree.leaves(stacked)[0].shape[0]
    layer = lambda i: stacked[i] if listed else jax.tree.map(lambda a: a[i], stacked)  # noqa: E731
    fetched = fetch(layer(0))
    if layers == "scan":

        def body(carry: tuple[Array, PyTree], next_layer: PyTree) -> tuple[Any, None]:
            x, here = carry
            return (block(x, here), fetch(next_layer)), None

        rest = jax.tree.map(lambda a: a[1:], stacked)
        (x, fetched), _ = jax.lax.scan(body, (x, fetched), rest)
        return block(x, fetched)
    for i in range(count):
        ahead = fetch(layer(i + 1)) if i + 1 < count else None
        x = block(x, fetched)
        fetched = ahead
    return x


@shard_map_primitive
def sync_in_backward(tree: PyTree, axes_tree: PyTree, *, dtype: str = "float32") -> PyTree:
    """``tree`` cast varying over each leaf's axes (no communication), whose cotangents are
    all-reduced there in backward: ``dw{U_axes} -> dw``, wherever the transpose stands.

    DP's overlapped gradient sync: applied to each layer's params through ``prefetch_layers``,
    it all-reduces layer i + 1's gradients in layer i's backward step instead of in one bucket
    at the step's end. Each bucket (the leaves sharing their axes and varying axes, as in
    ``sync_grads``) is laid out as [n, r, 128] and reduced as a reduce-scatter of permutes
    (``overlap.scatter_by_permutes``: recursive halving, or a ring) then an all-gather: the TPU
    compiler runs an all-reduce synchronously wherever it stands, but schedules permutes and
    all-gathers beside matmuls that do not need them. Bytes: 2(n − 1)/n · the padded bucket,
    an all-reduce's. ``dtype``: the wire dtype (``Plan.grad_sync``; the sums come back in the
    cotangent's own). The result is invariant over the axes, as after ``sync_grads``: pass
    the leaves uncast (not ``vary``'d there), and leave them out of the step-end sync.
    """
    leaves, treedef = jax.tree.flatten(tree)
    axes = jax.tree.leaves(axes_tree, is_leaf=lambda a: isinstance(a, tuple))
    if len(axes) != len(leaves):  # a tuple of leaves reads as one leaf: use a list
        raise ValueError(f"axes_tree has {len(axes)} axis tuples, the tree {len(leaves)} leaves.")
    return jax.tree.unflatten(treedef, _synced_in_backward(leaves, tuple(axes), dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _synced_in_backward(leaves: list[Array], axes: tuple[Axes, ...], dtype: str) -> list[Array]:
    return [vary_leaf(w, a) if a else w for w, a in zip(leaves, axes, strict=True)]


def _synced_fwd(leaves: list[Array], axes: tuple[Axes, ...], dtype: str) -> tuple:
    return _synced_in_backward(leaves, axes, dtype), None


def _synced_bwd(axes: tuple[Axes, ...], dtype: str, _: None, cts: list[Array]) -> tuple:
    out = list(cts)
    groups: dict[tuple[Axes, frozenset[str]], list[int]] = defaultdict(list)
    for i, (ct, a) in enumerate(zip(cts, axes, strict=True)):
        if a:
            groups[(a, varying_axes(ct))].append(i)
    for (a, _varying), members in groups.items():
        flat = jnp.concatenate([cts[i].reshape(-1).astype(dtype) for i in members])
        # DP: this layer's gradient sum, a reduce-scatter of permutes then an all-gather.
        summed = all_reduce_permuted(flat, a)
        offset = 0
        for i in members:
            piece = summed[offset : offset + cts[i].size]
            out[i] = piece.reshape(cts[i].shape).astype(cts[i].dtype)
            offset += cts[i].size
    return (out,)


_synced_in_backward.defvjp(_synced_fwd, _synced_bwd)


@shard_map_primitive
def fsdp_gather(
    tree: PyTree,
    dims_tree: PyTree,
    axis: str = "data",
    *,
    bucket: bool = True,
    tiles: Tiles | None = None,
    permuted_back: bool = False,
) -> PyTree:
    """All-gathers each FSDP-split leaf along its split dim: ``w[D_data] -> w[D]``.

    ``dims_tree`` matches ``tree`` with the split dim of each leaf, or None for leaves that are
    not split. With ``bucket`` (the default) the split leaves travel as ONE buffer per group
    of leaves sharing a dtype and varying axes (FSDP2's and DDP's buckets): each fragment is
    flattened with its split dim first, the concatenation is all-gathered once (flat, or with
    ``tiles`` as padded [r, 128] tiles the TPU compiler keeps: ``parallel.tiles``), and
    every leaf is cut back out of the gathered buffer. Backward: one reduce-scatter per bucket
    (the transpose). Leaves with different varying axes never share a buffer: a concatenation
    would cast the invariant ones, and its transpose would all-reduce their cotangents.
    ``bucket=False`` gathers leaf by leaf (same bytes, unpadded; one op per leaf).
    ``permuted_back``: each bucket's backward reduce-scatter is built from permutes
    (``overlap.gather_permuted_back``), which the TPU compiler overlaps where a
    reduce-scatter stays synchronous (``prefetch_layers``' backward).
    Cost: (n−1)/n · the gathered bytes forward (each bucket's padded), the same backward.
    """
    leaves, treedef = jax.tree.flatten(tree)
    dims = _dims(dims_tree, leaves)
    if not bucket:
        out = list(leaves)
        for i, (x, dim) in enumerate(zip(leaves, dims, strict=True)):
            if dim is not None:  # FSDP: materialise the whole weight just before it is used.
                out[i] = all_gather(x, axis, axis_dim=dim, tiled=True)
        return jax.tree.unflatten(treedef, out)
    gathered = _bucket_gather(leaves, dims, axis, "varying", tiles, permuted_back)
    return jax.tree.unflatten(treedef, gathered)


def _dims(dims_tree: PyTree, leaves: list[Array]) -> list[int | None]:
    dims = jax.tree.leaves(dims_tree, is_leaf=lambda x: x is None)
    if len(dims) != len(leaves):
        raise ValueError(f"dims_tree has {len(dims)} leaves, the params {len(leaves)}.")
    return dims


def _buckets(leaves: Sequence[Array], dims: Sequence[int | None]) -> list[list[tuple[int, int]]]:
    """(index, split dim) of the split leaves grouped by (dtype, varying axes): one flat
    buffer each."""
    groups: dict[tuple[Any, frozenset[str]], list[tuple[int, int]]] = defaultdict(list)
    for i, (x, dim) in enumerate(zip(leaves, dims, strict=True)):
        if dim is not None:
            groups[(x.dtype, varying_axes(x))].append((i, dim))
    return list(groups.values())


def _bucket_gather(
    leaves: list[Array],
    dims: list[int | None],
    axis: str,
    to: str,
    tiles: Tiles | None = None,
    permuted_back: bool = False,
) -> list[Array]:
    """``w[D_X] -> w[D]`` for every split leaf, one all-gather per bucket (``tiles``: laid out
    as ``parallel.tiles.wire`` says)."""
    out = list(leaves)
    for members in _buckets(leaves, dims):
        flat = [jnp.moveaxis(leaves[i], dim, 0).reshape(-1) for i, dim in members]
        # FSDP / ZeRO: one buffer of every fragment in the bucket, gathered once.
        laid = wire(jnp.concatenate(flat), tiles, axis)
        if permuted_back:  # FSDP's prefetch: the gradient's reduce-scatter as permutes
            gathered = gather_permuted_back(laid, axis)
        else:
            gathered = all_gather(laid, axis, to=to)  # [n, ...]
        gathered = gathered.reshape(gathered.shape[0], -1)  # [n, Σ sizes (+ padding)]
        offset = 0
        for (i, dim), piece in zip(members, flat, strict=True):
            moved = jnp.moveaxis(leaves[i], dim, 0).shape
            block = gathered[:, offset : offset + piece.size].reshape(-1, *moved[1:])
            out[i] = jnp.moveaxis(block, 0, dim)  # device-major blocks along the split dim
            offset += piece.size
    return out


@shard_map_primitive
def zero_scatter(
    grads: PyTree,
    dims_tree: PyTree,
    axis: str = "data",
    *,
    tiles: Tiles | None = None,
    permuted: bool = False,
) -> PyTree:
    """Reduce-scatters each split leaf's gradient: ``dw[D]{U_X} -> dw[D_X]``, in buckets.

    The exact transpose of ``fsdp_gather``'s bucketed all-gather (ZeRO-1's and ZeRO-2's
    gradient reduction): each gradient is cut into n blocks along its dim, the blocks are laid
    out device-major in one [n, Σ] buffer per bucket (``tiles``: each row padded to the
    [r, 128] the TPU compiler keeps as a reduce-scatter, ``parallel.tiles``), and ONE
    reduce-scatter leaves device k the sum of row k. Leaves whose dim is None pass through.
    ``permuted``: of permutes (``overlap.scatter_by_permutes``), which a TPU overlaps.
    Cost: (n−1)/n · the full gradient bytes (each bucket's padded).
    """
    leaves, treedef = jax.tree.flatten(grads)
    dims = _dims(dims_tree, leaves)
    n = jax.lax.axis_size(axis)
    out = list(leaves)
    for members in _buckets(leaves, dims):
        # row k of each: the block device k keeps
        rows = [jnp.moveaxis(leaves[i], dim, 0).reshape(n, -1) for i, dim in members]
        joined = jnp.concatenate(rows, axis=1)  # [n, Σ / n]
        laid = jax.vmap(lambda row: wire(row, tiles, axis))(joined)  # [n, Σ/n] | [n, r, 128]
        # ZeRO: each device needs only the summed gradient of the slice it updates.
        scatter = scatter_by_permutes if permuted else reduce_scatter
        summed = scatter(laid, axis).reshape(-1)[: joined.shape[1]]
        offset = 0
        for (i, dim), row in zip(members, rows, strict=True):
            moved = jnp.moveaxis(leaves[i], dim, 0).shape
            block = summed[offset : offset + row.shape[1]].reshape(-1, *moved[1:])
            out[i] = jnp.moveaxis(block, 0, dim)
            offset += row.shape[1]
    return jax.tree.unflatten(treedef, out)


@shard_map_primitive
def zero_slices(tree: PyTree, dims_tree: PyTree, axis: str = "data") -> PyTree:
    """This device's slice of each split leaf, ``w[D] -> w[D_X]`` (no communication); leaves
    whose dim is None are returned whole."""
    n, idx = jax.lax.axis_size(axis), jax.lax.axis_index(axis)

    def local(w: Array, dim: int | None) -> Array:
        if dim is None:
            return w
        size = w.shape[dim] // n
        w = vary_leaf(w, axis)
        return jax.lax.dynamic_slice_in_dim(w, idx * size, size, dim)

    return jax.tree.map(local, tree, dims_tree, is_leaf=lambda x: x is None)


@shard_map_primitive
def zero_attach(
    full: PyTree,
    frags: PyTree,
    dims_tree: PyTree,
    axis: str = "data",
    *,
    tiles: Tiles | None = None,
    permuted: bool = False,
) -> PyTree:
    """ZeRO-2's hook: returns ``full`` (use it in the forward); its gradient goes to ``frags``,
    reduce-scattered where backward makes it: ``dw[D]{U_X} -> dw[D_X]``.

    Differentiate with respect to ``frags`` (``zero_slices(full, dims)``; only their shapes
    matter), with ``full`` cast varying over ``axis`` (``vary``) so its cotangent arrives
    unreduced. Inside a ``lax.scan`` body this reduce-scatters each layer's gradients in that
    layer's backward step, so the stacked gradients the scan returns are already 1/n: the
    whole gradient of one layer is alive at a time, never all of them (the memory ZeRO-2
    saves over ZeRO-1). Leaves whose dim is None are passed as ``frags`` whole and returned.
    ``tiles``, ``permuted``: as ``zero_scatter``'s; with ``permuted``, through
    ``prefetch_layers`` over ``(blocks, frags)``, layer i + 1's runs under layer i's backward.
    """
    full_leaves, treedef = jax.tree.flatten(full)
    frag_leaves = jax.tree.leaves(frags)
    dims = _dims(dims_tree, full_leaves)
    split = [i for i, d in enumerate(dims) if d is not None]
    split_dims = [dims[i] for i in split]

    @jax.custom_vjp
    def attach(fulls: list[Array], _frags: list[Array]) -> list[Array]:
        return fulls

    def bwd(_: None, cts: list[Array]) -> tuple[None, list[Array]]:
        return None, zero_scatter(list(cts), split_dims, axis, tiles=tiles, permuted=permuted)

    attach.defvjp(lambda fulls, _frags: (fulls, None), bwd)
    used = attach([full_leaves[i] for i in split], [frag_leaves[i] for i in split])
    out = list(frag_leaves)
    for i, w in zip(split, used, strict=True):
        out[i] = w
    return jax.tree.unflatten(treedef, out)


@shard_map_primitive
def zero_update(
    optimizer: optax.GradientTransformation,
    grads_frag: PyTree,
    opt_state_frag: Any,
    params: PyTree,
    dims_tree: PyTree,
    axis: str = "data",
    *,
    tiles: Tiles | None = None,
) -> tuple[PyTree, Any]:
    """ZeRO's update: the local slice with the local state, then the params all-gathered.

    ``w[D] -> w[D_X]`` (a slice, free); ``update(dw[D_X], state[D_X], w[D_X])``;
    ``w[D_X] --AllGather--> w[D]``, one all-gather per bucket, typed invariant (the params
    leave ``shard_map`` replicated). Leaves whose dim is None are updated whole (their
    gradients synced, their state replicated).

    Args:
      optimizer: an elementwise optax transformation (e.g. AdamW; no global norms: clip with
        ``global_norm`` and ``clip_by_norm`` first).
      grads_frag: synced gradients, each split leaf already reduce-scattered (``zero_scatter``).
      opt_state_frag: this device's optimizer-state slice, split like ``dims_tree``.
      params: replicated params.
      dims_tree: the split dim of each leaf (or None).
      tiles: the all-gathers' buckets as padded [r, 128] tiles (``parallel.tiles``; on a TPU).
    """
    w_frag = zero_slices(params, dims_tree, axis)
    w_frag, opt_state_frag = optax_update(optimizer, grads_frag, opt_state_frag, w_frag)
    leaves, treedef = jax.tree.flatten(w_frag)
    gathered = _bucket_gather(leaves, _dims(dims_tree, leaves), axis, "invarying", tiles)
    return jax.tree.unflatten(treedef, gathered), opt_state_frag


@shard_map_primitive
def zero1_update(
    optimizer: optax.GradientTransformation,
    grads: PyTree,
    opt_state_frag: Any,
    params: PyTree,
    dims_tree: PyTree,
    axis: str = "data",
    *,
    tiles: Tiles | None = None,
) -> tuple[PyTree, Any]:
    """ZeRO-1 step inside ``shard_map``: optimizer state split over ``axis``, params replicated.

    ``dw{U_data} --ReduceScatter--> dw[D_data]`` (``zero_scatter``); the leaves whose dim is
    None are all-reduced whole; then ``zero_update``. Two collectives per bucket, the bytes of
    one all-reduce: (n−1)/n·P·w + (n−1)/n·P·w.

    Args:
      grads: per-device partial gradients (varying over ``axis``), like ``params``; the other
        arguments are ``zero_update``'s (``tiles`` lays out the reduce-scatters' buckets too).
    """
    is_none = lambda x: x is None  # noqa: E731
    whole = jax.tree.map(
        lambda g, d: jax.lax.psum(g, axis) if d is None else g, grads, dims_tree, is_leaf=is_none
    )
    g_frag = zero_scatter(whole, dims_tree, axis, tiles=tiles)
    return zero_update(optimizer, g_frag, opt_state_frag, params, dims_tree, axis, tiles=tiles)


def optax_update(
    optimizer: optax.GradientTransformation, grads: PyTree, opt_state: Any, params: PyTree
) -> tuple[PyTree, Any]:
    """One optax update, under "standard" dtype promotion (optax mixes Python floats with int32
    step counts, which strict promotion rejects)."""
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state


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
    local = vary_leaf(local, axes)
    return jnp.sqrt(jax.lax.psum(local, tuple(axes)))


def clip_by_norm(grads: PyTree, norm: Array, max_norm: float) -> PyTree:
    """``grads · max_norm / norm`` where ``norm ≥ max_norm``: optax.clip_by_global_norm's rule,
    with the norm given (``global_norm`` of the shards). Elementwise: no communication."""
    keep = norm < max_norm
    return jax.tree.map(
        lambda g: jax.lax.select(keep, g, (g / norm.astype(g.dtype)) * max_norm), grads
    )


# ------------------------------------------------------------------ optimizer state


def opt_state_specs(optimizer: optax.GradientTransformation, params: PyTree, specs: PyTree) -> Any:
    """``optimizer``'s state as a tree of PartitionSpecs: param-shaped leaves as their param's
    spec, the rest (step counts) replicated. ``params`` may be arrays, tracers or shapes."""
    with jax.numpy_dtype_promotion("standard"):  # optax is not strict-promotion clean
        shapes = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        shapes,
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )


def opt_state_layout(
    optimizer: optax.GradientTransformation,
    params: PyTree,
    specs: PyTree,
    sharding: Callable[[P], NamedSharding],
) -> tuple[Any, Any]:
    """(shapes, shardings) of ``optimizer``'s state: param-shaped leaves split like their param,
    the rest (step counts) replicated. ``params`` may be arrays or shapes."""
    with jax.numpy_dtype_promotion("standard"):  # optax is not strict-promotion clean
        shapes = jax.eval_shape(optimizer.init, params)
    state_specs = opt_state_specs(optimizer, params, specs)
    return shapes, jax.tree.map(sharding, state_specs, is_leaf=lambda x: isinstance(x, P))
