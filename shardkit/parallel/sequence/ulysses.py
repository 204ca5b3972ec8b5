"""Ulysses (DeepSpeed) and USP: all-to-alls trade the token split for a head split.

``attention_ulysses`` runs ``attention_local`` on the whole sequence for h/n heads between two
all-to-alls; ``attention_usp`` runs Ulysses over one axis around a ring over another, on a
``usp_mesh`` (the seq axis split into ``seq_ring × seq_ulysses``). Shapes, signatures and
masking rules: the package docstring (``shardkit.parallel.sequence``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jaxtyping import Array, Float

from shardkit import kernels
from shardkit.mesh import AXES, PlanError
from shardkit.parallel.sequence import layouts
from shardkit.parallel.sequence.blockwise import (
    Block,
    KeyValid,
    Lse,
    Segments,
    _and_valid,
    _block_stats,
    _check_blocks,
    _check_num_valid,
    _finish,
    _mask,
    _positions_valid,
    _Queries,
)
from shardkit.parallel.sequence.ring import _attention_ring_grouped
from shardkit.parallel.vma import shard_map_primitive

SEQ_RING = "seq_ring"
SEQ_ULYSSES = "seq_ulysses"
USP_SEQ = (SEQ_RING, SEQ_ULYSSES)
USP_AXES = ("data", "stage", "expert", SEQ_RING, SEQ_ULYSSES, "model")
# inner(q, k, v, key_valid, segment_ids) on Ulysses-gathered tokens -> (out, lse)
_Attention = Callable[[Array, Array, Array, Array | None, Array | None], tuple[Array, Array]]


# ----------------------------------------------------------------------------- Ulysses


@shard_map_primitive
def seq_to_heads(x: Float[Array, "b t_local h k"], axis: str) -> Float[Array, "b t h_local k"]:
    """[b, t/n, h, k] -> [b, t, h/n, k]: x[B, T_X, H, K] --AllToAll--> x[B, T, H_X, K]."""
    # Trade the token split for a head split: each device then sees every token of h/n heads.
    return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


@shard_map_primitive
def heads_to_seq(x: Float[Array, "b t h_local k"], axis: str) -> Float[Array, "b t_local h k"]:
    """[b, t, h/n, k] -> [b, t/n, h, k]: x[B, T, H_X, K] --AllToAll--> x[B, T_X, H, K]."""
    # Undo seq_to_heads: each device gets its own tokens back, now for every head.
    return jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def _check_heads(heads: int, axis: str) -> None:
    n = jax.lax.axis_size(axis)
    if heads % n:
        raise PlanError(
            f"Ulysses over mesh axis {axis!r} of size {n} needs a local head count divisible by "
            f"{n}, but there are {heads} heads."
        )


def _replicate_kv_heads(x: Array, n: int) -> Array:
    """k or v [b, t, h_kv, k] -> [b, t, lcm(h_kv, n), k]: each KV head repeated in place.

    Ulysses splits heads over n devices; with h_kv not a multiple of n (e.g. MQA, h_kv = 1) each
    KV head is repeated n / gcd(h_kv, n) times, the standard replication: query head i still
    meets KV head i // g on whichever device it lands, and autodiff sums the copies' gradients.
    The all-to-alls then move lcm(h_kv, n) / h_kv times the KV bytes.
    """
    repeats = n // math.gcd(x.shape[2], n)
    return x if repeats == 1 else jnp.repeat(x, repeats, axis=2)


def _ulysses(
    q: Array,
    k: Array,
    v: Array,
    key_valid: Array | None,
    segment_ids: Array | None,
    axis: str,
    inner: _Attention,
) -> tuple[Array, Array]:
    """Ulysses over ``axis`` around ``inner``, an attention over the gathered tokens."""
    _check_blocks(q, k, v, key_valid, segment_ids)
    _check_heads(q.shape[2], axis)
    k, v = (_replicate_kv_heads(x, jax.lax.axis_size(axis)) for x in (k, v))
    q_h, k_h, v_h = (seq_to_heads(x, axis) for x in (q, k, v))
    if key_valid is not None:
        # Every device now needs every key's validity; a data mask must be gathered (it is
        # tiny). A padding mask passed as num_valid is computed locally instead.
        key_valid = jax.lax.all_gather(key_valid, axis, axis=key_valid.ndim - 1, tiled=True)
    if segment_ids is not None:  # data too: every gathered token needs its segment id
        segment_ids = jax.lax.all_gather(segment_ids, axis, axis=1, tiled=True)
    out, lse = inner(q_h, k_h, v_h, key_valid, segment_ids)
    # lse[B, H_X, T] -> lse[B, H, T_X]: back to the token split of q.
    lse = jax.lax.all_to_all(lse, axis, split_axis=2, concat_axis=1, tiled=True)
    return heads_to_seq(out, axis), lse


@shard_map_primitive
def attention_ulysses(
    q: Block,
    k: Block,
    v: Block,
    key_valid: KeyValid = None,
    axis: str = "seq",
    *,
    num_valid: int | None = None,
    causal: bool = False,
    layout: str = "contiguous",
    segment_ids: Segments = None,
    kernel: str = "auto",
) -> tuple[Block, Lse]:
    """Ulysses (DeepSpeed) sequence parallelism over mesh axis ``axis`` of size n.

    All-to-all from a token split to a head split, ``attention_local`` over the full sequence
    for h/n heads, all-to-all back. Forward: four all-to-alls of q, k, v, out (plus one of the
    small lse, and an all-gather of ``key_valid`` if one is given); backward: four all-to-alls.

    Signature: q, k, v[B, T_X, H, K] -> out[B, T_X, H, K], lse[B, H, T_X].

    Args:
      q: the local query block [b, t, h, k]; h must be divisible by n.
      k: the local key block [b, t, h_kv, k], h_kv dividing h. With h_kv not a multiple of n
        each KV head is first repeated n / gcd(h_kv, n) times (the standard replication; the
        k, v all-to-alls then move that many times their bytes).
      v: the local value block, shaped like k.
      key_valid: local bool mask [b, t] or [t] (True = real key), or None: an arbitrary data
        mask, all-gathered over ``axis``.
      axis: the mesh axis the sequence is split over.
      num_valid: static; keys at global index ≥ num_valid are padding. The communication-free
        path for padding masks: every device builds ``arange(n·t) < num_valid`` itself. ANDed
        with ``key_valid``.
      causal: the query at global position i sees the keys at global position ≤ i: after the
        all-to-all every device holds the whole sequence (in device order), so the mask is local.
      layout: the token layout over ``axis`` (see ``attention_ring``); Ulysses works on any,
        reading each gathered token's position from ``layouts.positions``.
      segment_ids: local int [b, t] for packed sequences (a query sees its own segment's
        keys only); all-gathered over ``axis``, like ``key_valid``.
      kernel: the local attention's kernel (see ``attention_local``); on Pallas, a causal
        zigzag or striped sequence is put in position order first (a local permutation).

    Returns:
      out [b, t, h, k] and lse [b, h, t] as ``attention_local`` on the whole sequence.

    Raises:
      PlanError: (a ValueError) at trace time, when h is not divisible by n.
    """
    _check_num_valid(num_valid)
    local = functools.partial(
        _whole_sequence, axis=axis, num_valid=num_valid, causal=causal, layout=layout,
        kernel=kernel,
    )  # fmt: skip
    return _ulysses(q, k, v, key_valid, segment_ids, axis, local)


def _whole_sequence(
    q: Array,
    k: Array,
    v: Array,
    key_valid: Array | None,
    segs: Array | None,
    *,
    axis: str,
    num_valid: int | None,
    causal: bool,
    layout: str,
    kernel: str,
) -> tuple[Array, Array]:
    """Ulysses' local attention: every device holds all s keys in device order (h/n heads),
    so the masks come from positions alone."""
    n, s = jax.lax.axis_size(axis), k.shape[1]
    pos = jnp.asarray(layouts.positions(layout, n, s // n).reshape(-1))
    valid = _and_valid(key_valid, _positions_valid(pos, num_valid, s))
    if kernels.resolve_kernel(kernel, s) == "pallas":
        order = np.argsort(layouts.positions(layout, n, s // n).reshape(-1))
        return _ordered_kernel(q, k, v, valid, segs, order if causal else None)
    key_pos = pos if causal else None
    mask = _mask(valid, _Queries(key_pos, segs), key_pos, segs)
    return _finish(_block_stats(q, k, v, mask), q.dtype)


def _ordered_kernel(
    q: Array, k: Array, v: Array, valid: Array | None, segs: Array | None, order: Any
) -> tuple[Array, Array]:
    """Pallas attention on whole blocks, causal in position ``order`` (a static permutation
    of the local tokens; None: bidirectional, any order)."""
    s = k.shape[1]
    if order is None:
        return kernels.attend(q, k, v, kernels.local_mask(s, s, False), segs, segs, valid, None)
    back = np.argsort(order)
    q, k, v = (x[:, order] for x in (q, k, v))
    segs = None if segs is None else segs[:, order]
    valid = None if valid is None else valid[..., order]
    out, lse = kernels.attend(q, k, v, kernels.local_mask(s, s, True), segs, segs, valid, None)
    return out[:, back], lse[..., back]


# ----------------------------------------------------------------------------- USP


@shard_map_primitive
def attention_usp(
    q: Block,
    k: Block,
    v: Block,
    key_valid: KeyValid = None,
    ulysses_axis: str = SEQ_ULYSSES,
    ring_axis: str = SEQ_RING,
    *,
    key_chunk: int | None = None,
    num_valid: int | None = None,
    causal: bool = False,
    layout: str = "contiguous",
    segment_ids: Segments = None,
    kernel: str = "auto",
) -> tuple[Block, Lse]:
    """Unified sequence parallelism: Ulysses over ``ulysses_axis``, ring over ``ring_axis``.

    The tokens must be split over (ring_axis, ulysses_axis), ring major: on a ``usp_mesh`` use
    ``P(..., USP_SEQ, ...)``. All-to-alls over the Ulysses axis gather each ring group's tokens
    and split heads; ring attention then runs over the ring axis on h/u heads.

    Signature: q, k, v[B, T_(R,U), H, K] -> out[B, T_(R,U), H, K], lse[B, H, T_(R,U)].

    Args:
      q: the local query block [b, t, h, k]; h must be divisible by the Ulysses axis size.
      k: the local key block, shaped like q.
      v: the local value block, shaped like q.
      key_valid: local bool mask [b, t] or [t] (True = real key), or None: an arbitrary data
        mask, all-gathered over the Ulysses axis, then sent round the ring with K and V.
      ulysses_axis: the mesh axis of the all-to-alls (minor in the token split).
      ring_axis: the mesh axis of the ring (major in the token split).
      key_chunk: most keys per chunk in the ring's hops (see ``attention_ring``).
      num_valid: static; keys at global index ≥ num_valid (in the sequence split over
        (ring_axis, ulysses_axis), ring major) are padding. The communication-free path for
        padding masks: after the all-to-all a ring position p holds tokens p·u·t ... (p+1)·u·t − 1,
        so the ring computes each hop's mask from positions (``attention_ring``'s num_valid).
      causal: the query at global position i sees the keys at global position ≤ i; the
        ring's block r holds the shards r·u ... (r+1)·u − 1 of the layout.
      layout: the token layout over the n = r·u devices of (ring_axis, ulysses_axis).
      segment_ids: local int [b, t] for packed sequences: all-gathered over the Ulysses axis,
        then sent round the ring with K and V.
      kernel: the ring hops' kernel (see ``attention_ring``).

    Returns:
      out [b, t, h, k] and lse [b, h, t] as ``attention_local`` on the whole sequence.
    """
    _check_num_valid(num_valid)
    u = jax.lax.axis_size(ulysses_axis)

    def ring(
        q: Array, k: Array, v: Array, key_valid: Array | None, segs: Array | None
    ) -> tuple[Array, Array]:
        return _attention_ring_grouped(
            q, k, v, key_valid, ring_axis, key_chunk, num_valid, causal, layout, u, segs, kernel
        )

    return _ulysses(q, k, v, key_valid, segment_ids, ulysses_axis, ring)


def usp_factor(seq_size: int, heads_local: int, ulysses: int | None = None) -> int:
    """The Ulysses degree u of a USP split of a seq axis of ``seq_size`` devices.

    None picks the largest u dividing both ``seq_size`` and ``heads_local`` (the heads per
    device before Ulysses, i.e. after any tensor-parallel split); the ring degree is then
    ``seq_size // u``. A given u is validated; PlanError (a ValueError) if it does not divide.
    """
    if ulysses is None:
        return math.gcd(seq_size, heads_local)
    if ulysses < 1 or seq_size % ulysses or heads_local % ulysses:
        raise PlanError(
            f"Ulysses degree {ulysses} must divide both the seq axis size {seq_size} and the "
            f"local head count {heads_local}."
        )
    return ulysses


def usp_mesh(mesh: Mesh, ulysses: int) -> Mesh:
    """Splits a ``data × stage × expert × seq × model`` mesh's seq axis into
    ``seq_ring × seq_ulysses``.

    The device grid [data, stage, expert, seq, model] is reshaped to
    [data, stage, expert, seq/u, u, model]
    with axes ``USP_AXES``, so ``P(..., USP_SEQ, ...)`` here places every shard on the same
    device as ``P(..., "seq", ...)`` on ``mesh``; data-, model- and seq-sharded arrays carry
    over as is.
    """
    if tuple(mesh.axis_names) != AXES:
        raise PlanError(f"usp_mesh needs a mesh with axes {AXES}, got {mesh.axis_names}.")
    data, stage, expert, seq, model = mesh.devices.shape
    if ulysses < 1 or seq % ulysses:
        raise PlanError(f"Ulysses degree {ulysses} must divide the seq axis size {seq}.")
    grid = mesh.devices.reshape(data, stage, expert, seq // ulysses, ulysses, model)
    return Mesh(grid, USP_AXES, axis_types=(AxisType.Auto,) * len(USP_AXES))
