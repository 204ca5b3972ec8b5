"""Ring attention over one mesh axis: K/V blocks travel by ``ppermute``, nothing is gathered.

``attention_ring`` (hand-written backward: saves q, k, v, out, lse) and
``attention_ring_autodiff`` (the memory baseline), on any token layout, causal or not, with
grouped-query heads and packed sequences; ``ring_work`` counts what a causal ring computes.
Block math: ``sequence.blockwise``; signatures and masks: the ``sequence`` package docstring.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from shardkit import kernels
from shardkit.parallel.sequence import layouts
from shardkit.parallel.sequence.blockwise import (
    _KV,
    Block,
    KeyValid,
    Lse,
    Segments,
    _and_valid,
    _attend,
    _attend_grads,
    _bhq_to_bqh,
    _check_blocks,
    _check_num_valid,
    _finish,
    _Masks,
    _merge,
    _no_stats,
    _positions_valid,
    _Queries,
    _query_slices,
    _Stats,
    _tiles,
)
from shardkit.parallel.vma import shard_map_primitive, vary_like

# ----------------------------------------------------------------------------- ring


def _ring_perm(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


class _Hops(NamedTuple):
    """How a ring's hops are laid out and computed (static): the token ``layout``, ring
    blocks of ``group`` consecutive shards of it (USP's Ulysses degree; a plain ring: 1), and
    the ``kernel`` each hop runs on ("jnp" or "pallas", resolved)."""

    layout: str
    group: int = 1
    kernel: str = "jnp"


def _kernel_cases(hops: _Hops, n: int, t: int, s: int, causal: bool) -> tuple[tuple, Array]:
    """The Pallas path's static hop masks and case [n, n] (receiver, source) indexing them."""
    if not causal:
        return (kernels.full_mask(t, s),), jnp.zeros((n, n), jnp.int32)
    table = layouts.positions(hops.layout, n * hops.group, t // hops.group).reshape(n, t)
    masks, case = kernels.hop_masks(np.asarray(table))
    return masks, jnp.asarray(case)


def _hop_case(case: Array, axis: str, step: Array | int) -> Array:
    """The case of the block held after ``step`` hops (it started on device i − step)."""
    me = jax.lax.axis_index(axis)
    return case[me, (me - step) % jax.lax.axis_size(axis)]


def _kernel_attend(
    stats: _Stats, q: Array, q_seg: Array | None, kv: _KV, cases: tuple, index: Array
) -> _Stats:
    """``stats`` merged with this hop's (out, lse) from the Pallas kernel of its case's mask
    (a case whose mask hides every pair is skipped)."""
    k, v, valid, _, seg = kv

    def attend(mask: kernels.HopMask) -> Callable[[_Stats], _Stats]:
        def run(stats: _Stats) -> _Stats:
            out, lse = kernels.block_attention(
                q, k, v, mask, q_seg=q_seg, kv_seg=seg, key_valid=valid
            )
            has_key = (lse > kernels.MASK_VALUE / 2).astype(jnp.float32)
            return _merge(stats, (lse, has_key, out.astype(jnp.float32)))

        return (lambda stats: stats) if mask.empty else run

    branches = [attend(m) for m in cases[0]]
    if len(branches) == 1:
        return branches[0](stats)
    return jax.lax.switch(index, branches, stats)


def _kernel_grads(
    dq: Array,
    q: Array,
    q_seg: Array | None,
    kv: _KV,
    cases: tuple,
    index: Array,
    d_out: Array,
    lse: Array,
    delta: Array,
) -> tuple[Array, Array, Array]:
    """(dq + this hop's dq, its dk, dv) from the Pallas backward of its case's mask."""
    k, v, valid, _, seg = kv

    def grads(mask: kernels.HopMask) -> Callable[[Array], tuple[Array, Array, Array]]:
        def run(dq: Array) -> tuple[Array, Array, Array]:
            dq_h, dk, dv = kernels.block_attention_grads(
                q, k, v, mask, d_out, lse, delta, q_seg=q_seg, kv_seg=seg, key_valid=valid
            )
            return dq + dq_h, dk, dv

        def skip(dq: Array) -> tuple[Array, Array, Array]:
            like = (q, k, v, valid, seg, d_out, lse, delta)
            dk, dv = (vary_like(jnp.zeros(x.shape, jnp.float32), *like) for x in (k, v))
            return dq, dk, dv

        return skip if mask.empty else run

    branches = [grads(m) for m in cases[0]]
    if len(branches) == 1:
        return branches[0](dq)
    return jax.lax.switch(index, branches, dq)


def _ring_table(layout: str, n: int, group: int, t: int) -> Array:
    """int32 [n, t]: the global positions of the block ring device j holds, per layout.

    A ring block is ``group`` consecutive shards of ``layout`` over n·group shards of t/group
    tokens (USP: the Ulysses degree; a plain ring: 1). A static table: nothing travels.
    """
    if t % group:
        raise ValueError(f"a ring block of {t} tokens does not hold {group} whole shards.")
    return jnp.asarray(layouts.positions(layout, n * group, t // group).reshape(n, t))


def _hop_block(
    kv: tuple[Array, Array, Array | None, Array | None],
    step: Array | int,
    axis: str,
    num_valid: int | None,
    causal: bool,
    table: Array,
) -> _KV:
    """kv = (k, v, key_valid, key_seg), as it travels, with the padding mask (and, causal, the
    key positions) of the block held after ``step`` hops.

    That block started on device (i − step) mod n of the ring over ``axis``; ``table`` gives
    its keys' global positions. Computed locally: no communication.
    """
    n, s = jax.lax.axis_size(axis), kv[0].shape[1]
    key_pos = table[(jax.lax.axis_index(axis) - step) % n]
    valid = _and_valid(kv[2], _positions_valid(key_pos, num_valid, n * s))
    return kv[0], kv[1], valid, key_pos if causal else None, kv[3]


def _ring_queries(axis: str, causal: bool, table: Array, segment_ids: Array | None) -> _Queries:
    """This device's queries on the ring over ``axis``: global positions (causal) and segments."""
    return _Queries(table[jax.lax.axis_index(axis)] if causal else None, segment_ids)


def _ring_forward(
    q: Array,
    k: Array,
    v: Array,
    masks: _Masks,
    axis: str,
    chunk: int,
    num_valid: int | None,
    causal: bool,
    hops: _Hops,
) -> tuple[Array, Array]:
    """(out, lse): K/V blocks travel the ring; each is attended ``chunk`` keys at a time (jnp)
    or by the Pallas kernel of its hop's mask."""
    key_valid, segment_ids = masks
    n = jax.lax.axis_size(axis)
    table = _ring_table(hops.layout, n, hops.group, k.shape[1])
    block = functools.partial(
        _hop_block, axis=axis, num_valid=num_valid, causal=causal, table=table
    )
    if hops.kernel == "pallas":
        cases = _kernel_cases(hops, n, q.shape[1], k.shape[1], causal)

        def attend(stats: _Stats, kv: _KV, step: Array | int) -> _Stats:
            index = _hop_case(cases[1], axis, step)
            return _kernel_attend(stats, q, segment_ids, kv, cases, index)
    else:
        tiles = _tiles(k.shape[1], chunk, causal, hops.layout, hops.group)[1]
        q_pos = _ring_queries(axis, causal, table, segment_ids)

        def attend(stats: _Stats, kv: _KV, step: Array | int) -> _Stats:
            return _attend(stats, q, q_pos, kv, chunk, tiles)

    def hop(carry: tuple[_Stats, tuple], step: Array) -> tuple[tuple[_Stats, tuple], None]:
        stats, kv = carry
        # Pass the K/V block (with key_valid, segment ids if any) one step round the ring: after j
        # hops this device holds the block that started on device i − j.
        kv = jax.lax.ppermute(kv, axis, _ring_perm(n))
        return (attend(stats, block(kv, step), step), kv), None

    kv = (k, v, key_valid, segment_ids)
    stats = attend(_no_stats(q, block(kv, 0)), block(kv, 0), 0)
    if n > 1:
        (stats, _), _ = jax.lax.scan(hop, (stats, kv), jnp.arange(1, n))
    return _finish(stats, q.dtype)


@shard_map_primitive
def attention_ring_autodiff(
    q: Block,
    k: Block,
    v: Block,
    key_valid: KeyValid = None,
    axis: str = "seq",
    *,
    key_chunk: int | None = None,
    num_valid: int | None = None,
    causal: bool = False,
    layout: str = "contiguous",
    segment_ids: Segments = None,
) -> tuple[Block, Lse]:
    """Ring attention forward, differentiated by plain JAX autodiff: the memory BASELINE.

    Same arguments, results, sharding signature and forward as ``attention_ring``. Autodiff
    through the hop and chunk loops keeps every hop's probabilities [b, h, t_local, s_local]
    (chunk by chunk) for backward, O(S²/n) per device, and sends the K/V cotangents back the
    other way round the ring; use ``attention_ring``, whose hand-written backward saves only
    q, k, v, out and lse.
    """
    _check_ring(q, k, v, key_valid, num_valid, causal, segment_ids)
    chunk = _tiles(k.shape[1], key_chunk, causal, layout, 1)[0]
    return _ring_forward(
        q, k, v, (key_valid, segment_ids), axis, chunk, num_valid, causal, _Hops(layout)
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _ring(
    q: Array,
    k: Array,
    v: Array,
    masks: _Masks,
    axis: str,
    chunk: int,
    num_valid: int | None,
    causal: bool,
    hops: _Hops,
) -> tuple[Array, Array]:
    return _ring_forward(q, k, v, masks, axis, chunk, num_valid, causal, hops)


def _ring_fwd(
    q: Array,
    k: Array,
    v: Array,
    masks: _Masks,
    axis: str,
    chunk: int,
    num_valid: int | None,
    causal: bool,
    hops: _Hops,
) -> tuple[tuple[Array, Array], tuple]:
    out, lse = _ring_forward(q, k, v, masks, axis, chunk, num_valid, causal, hops)
    return (out, lse), (q, k, v, masks, out, lse)


def _ring_bwd(
    axis: str,
    chunk: int,
    num_valid: int | None,
    causal: bool,
    hops: _Hops,
    res: tuple,
    cts: tuple[Array, Array],
) -> tuple:
    q, k, v, masks, out, lse = res
    key_valid, segment_ids = masks
    d_out, d_lse = cts
    f32 = jnp.float32
    delta = _bhq_to_bqh(jnp.sum(d_out.astype(f32) * out.astype(f32), -1)) - d_lse
    n = jax.lax.axis_size(axis)
    table = _ring_table(hops.layout, n, hops.group, k.shape[1])
    if hops.kernel == "pallas":
        cases = _kernel_cases(hops, n, q.shape[1], k.shape[1], causal)

        def grads(dq: Array, kv: _KV, step: Array | int) -> tuple[Array, Array, Array]:
            index = _hop_case(cases[1], axis, step)
            return _kernel_grads(dq, q, segment_ids, kv, cases, index, d_out, lse, delta)
    else:
        q_pos = _ring_queries(axis, causal, table, segment_ids)
        tiles = _tiles(k.shape[1], chunk, causal, hops.layout, hops.group)[1]

        def grads(dq: Array, kv: _KV, step: Array | int) -> tuple[Array, Array, Array]:
            return _attend_grads(dq, q, q_pos, kv, chunk, d_out, lse, delta, tiles)

    block = functools.partial(
        _hop_block, axis=axis, num_valid=num_valid, causal=causal, table=table
    )

    def hop(carry: tuple, step: Array) -> tuple[tuple, None]:
        dq, kv, dkv = carry
        # K, V (key_valid, segment ids if any) and their gradient accumulators travel together.
        kv, (dk, dv) = jax.lax.ppermute((kv, dkv), axis, _ring_perm(n))
        dq, dk_blk, dv_blk = grads(dq, block(kv, step), step)
        return (dq, kv, (dk + dk_blk, dv + dv_blk)), None

    kv = (k, v, key_valid, segment_ids)
    dq = vary_like(jnp.zeros(q.shape, f32), q, *block(kv, 0), d_out, lse, delta)
    dq, dk, dv = grads(dq, block(kv, 0), 0)
    if n > 1:
        (dq, _, (dk, dv)), _ = jax.lax.scan(hop, (dq, kv, (dk, dv)), jnp.arange(1, n))
        # n-th hop for dK, dV only: each accumulator returns to the device that owns its block,
        # already in K's and V's dtype (the same values: a cast commutes with the permute; in a
        # bf16 model half the bytes, what the TPU compiler would otherwise rewrite it to).
        dk, dv = jax.lax.ppermute((dk.astype(k.dtype), dv.astype(v.dtype)), axis, _ring_perm(n))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), (None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


@shard_map_primitive
def attention_ring(
    q: Block,
    k: Block,
    v: Block,
    key_valid: KeyValid = None,
    axis: str = "seq",
    *,
    key_chunk: int | None = None,
    num_valid: int | None = None,
    causal: bool = False,
    layout: str = "contiguous",
    segment_ids: Segments = None,
    kernel: str = "auto",
) -> tuple[Block, Lse]:
    """Ring attention over mesh axis ``axis`` with a memory-lean hand-written backward.

    Each device keeps its query block; K/V blocks (with a ``key_valid`` array, if given)
    travel the ring by ``ppermute`` for n − 1 hops and an online softmax (float32 running max
    and sum) merges them. Backward saves only q, k, v, out and lse, recomputes each block's
    probabilities, and sends dK, dV round the ring with their blocks (n hops: they end on their
    owner). No all-gather anywhere. n = 1 communicates nothing. Bytes sent per device: forward
    (n − 1)·(K + V [+ mask] blocks); backward (n − 1)·(K + V [+ mask]) + n·(dK + dV), the dK,
    dV accumulators in float32 whatever the input dtype (their sum would lose bits in bfloat16).
    Within a hop the keys are taken in chunks of c (flash-attention style, no communication),
    so the float32 logits tile is [b, h, t_local, c]: memory O(S/n) for a fixed c.

    Signature: q[B, T_X, H, K] · k, v[B, S_X, H, K] -> out[B, T_X, H, K], lse[B, H, T_X].

    Args:
      q: local queries [b, t, h, k]; k, v: local keys and values [b, s, h_kv, k] (h_kv
        divides h: grouped-query; the K/V blocks that travel hold h_kv heads, so the ring's
        bytes are h_kv / h of multi-head's).
      key_valid: local bool data mask [b, s] or [s] (True = real key; it travels), or None.
      axis: the mesh axis the sequence is split over.
      key_chunk: most keys per chunk (None: ``KEY_CHUNK``); c is evened out over the fewest
        chunks and the block padded to a multiple of c with masked keys.
      num_valid: static; keys at global index (axis index · s + local) ≥ num_valid are padding,
        masked from positions with no communication. ANDed with ``key_valid``.
      causal: static; the query at global position i sees the keys at global position ≤ i
        (t must equal s). The mask is computed from positions on every device: nothing extra
        travels. Every hop still runs (on masked tiles for keys in the future).
      layout: which global positions each device holds (``layouts.LAYOUTS``): "contiguous",
        or "zigzag" / "striped", which balance a causal mask's work over the ring; permute
        global arrays with ``layouts.to_layout`` first. Positions also place ``num_valid``.
      segment_ids: local int [b, t] for packed sequences: a query sees only keys of its own
        segment. Data: the key block's ids travel round the ring with it (b·t ints a hop).
      kernel: each hop's compute: "jnp" (``blockwise``, ``key_chunk`` keys at a time),
        "pallas" (``shardkit.kernels``: the splash kernel of the hop's mask, chosen per hop
        from the layout's few distinct masks; a hop that sees nothing is skipped) or "auto"
        (Pallas on a TPU backend, else jnp). Either moves the same bytes.

    Returns:
      out [b, t, h, k] (q's dtype) and lse [b, h, t] (float32), equal to attention over the
      whole sequence; see ``attention_local`` for rows without a valid key.
    """
    _check_ring(q, k, v, key_valid, num_valid, causal, segment_ids)
    chunk = _tiles(k.shape[1], key_chunk, causal, layout, 1)[0]
    masks = (key_valid, segment_ids)
    hops = _Hops(layout, 1, kernels.resolve_kernel(kernel, k.shape[1]))
    return _ring(q, k, v, masks, axis, chunk, num_valid, causal, hops)


def _attention_ring_grouped(
    q: Block,
    k: Block,
    v: Block,
    key_valid: KeyValid,
    axis: str,
    key_chunk: int | None,
    num_valid: int | None,
    causal: bool,
    layout: str,
    group: int,
    segment_ids: Segments = None,
    kernel: str = "auto",
) -> tuple[Block, Lse]:
    """``attention_ring`` whose blocks each hold ``group`` consecutive shards of ``layout``
    (USP's ring after its all-to-all over a Ulysses axis of size ``group``)."""
    _check_ring(q, k, v, key_valid, num_valid, causal, segment_ids)
    chunk = _tiles(k.shape[1], key_chunk, causal, layout, group)[0]
    masks = (key_valid, segment_ids)
    hops = _Hops(layout, group, kernels.resolve_kernel(kernel, k.shape[1]))
    return _ring(q, k, v, masks, axis, chunk, num_valid, causal, hops)


def _check_ring(
    q: Array,
    k: Array,
    v: Array,
    key_valid: Array | None,
    num_valid: int | None,
    causal: bool,
    segment_ids: Array | None = None,
) -> None:
    _check_blocks(q, k, v, key_valid, segment_ids)
    _check_num_valid(num_valid)
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"causal ring attention needs query and key blocks of one length (global positions "
            f"are block index · length); got {q.shape[1]} queries and {k.shape[1]} keys."
        )


def ring_work(layout: str, n: int, t: int, causal: bool, key_chunk: int | None = None) -> list[int]:
    """Per device, the (query, key) pairs a ring over n devices of t tokens each computes.

    Counted from the schedule ``attention_ring`` runs (its query tiles, key chunks and causal
    skips), not from a trace: every hop's tiles that some query of the tile can see count in
    full (their masked pairs are computed too). Bidirectional: n·t² on every device.
    """
    table = layouts.positions(layout, n, t)
    chunk, q_chunks = _tiles(t, key_chunk, causal, layout, 1)
    work = []
    for i in range(n):
        total = 0
        for src in range(n):
            keys = table[src]
            for r in _query_slices(t, q_chunks):
                for c in range(0, t, chunk):
                    visible = not causal or table[i][r].max() >= keys[c : c + chunk].min()
                    total += visible * (r.stop - r.start) * len(keys[c : c + chunk])
        work.append(total)
    return work
