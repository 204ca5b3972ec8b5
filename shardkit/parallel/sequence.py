"""Sequence-parallel attention: ring attention, Ulysses, their hybrid (USP), and token padding.

Every ``attention_*`` function runs INSIDE ``jax.shard_map`` on per-device blocks and takes the
names of the mesh axes it communicates over; ``sharded_attention`` wraps them for global arrays.
Nothing here assumes a ViT: bidirectional or causal attention (``causal=True``), with a
per-key validity mask, on any token layout (``layouts``: contiguous, zigzag, striped).

Dimension alphabet (vit_ref's): b batch, t tokens (q query tokens, s key tokens), h heads,
k head dim. Local blocks inside ``shard_map``:

  q           [b, t_local, h_local, k]   float32 or bfloat16 (one dtype for q, k, v)
  k, v        [b, t_local, h_kv, k]      h_kv divides h: grouped-query (h_kv = 1: multi-query;
                                         h_kv = h: multi-head); query head i uses KV head
                                         i // (h / h_kv), and only h_kv-head blocks travel
  key_valid   [b, t_local] or [t_local]  bool, True for a real key; or None (all keys real)
  out         [b, t_local, h_local, k]   q's dtype
  lse         [b, h_local, t_local]      float32 log-sum-exp of each query's logits

Sharding signatures (scaling-book notation; X the sequence axis, of size n):

  attention_local    q[B, T, H, K] · k, v[B, S, H, K] -> out[B, T, H, K], lse[B, H, T]  (no comm)
  attention_ring     q[B, T_X, H, K] · k, v[B, S_X, H, K] -> out[B, T_X, H, K], lse[B, H, T_X]
                     forward: K, V (and a key_valid array) hop round X by ppermute n−1 times;
                     backward: K, V hop n−1 times, dK, dV n times, so they end on their owner.
                     Within a hop the block's keys are taken c at a time (no communication),
                     so per-device memory is O(S/n · c), not O((S/n)²); c ≤ key_chunk.
  attention_ulysses  q, k, v[B, T_X, H, K] --AllToAll--> [B, T, H_X, K] -> attention_local
                     -> out[B, T, H_X, K] --AllToAll--> out[B, T_X, H, K];
                     lse[B, H_X, T] --AllToAll--> lse[B, H, T_X];
                     key_valid[B, S_X] --AllGather--> key_valid[B, S] (a key_valid array only).
  attention_usp      (U = Ulysses axis, R = ring axis, tokens split over (R, U), R major)
                     q, k, v[B, T_(R,U), H, K] --AllToAll over U--> [B, T_R, H_U, K]
                     -> attention_ring over R -> out[B, T_R, H_U, K] --AllToAll over U-->
                     out[B, T_(R,U), H, K]; lse likewise.

Masking: logits of invalid keys become ``MASK_VALUE`` (finite: −0.7 · float32 max, as in
Splash attention) and their probabilities are then set to exactly 0, so a query whose keys are
all invalid gets out = 0, lse = ``MASK_VALUE`` and zero, finite gradients. Logits, softmax
statistics and accumulators are float32 whatever the input dtype.

USP mesh: ``all_to_all`` and ``ppermute`` act on a whole mesh axis, so the hybrid needs the
sequence axis split in two. ``usp_mesh(mesh, u)`` turns a ``data × seq × model`` mesh into
``data × seq_ring × seq_ulysses × model`` by reshaping the seq dimension of the device grid
(ring major, Ulysses minor). The same devices hold the same tokens: ``P(..., USP_SEQ, ...)`` with
``USP_SEQ = ("seq_ring", "seq_ulysses")`` on the split mesh places data exactly as
``P(..., "seq", ...)`` does on the original, and a collective over ``"seq"`` becomes one over
``USP_SEQ``. Ulysses is the minor axis so its all-to-alls stay among neighbouring devices.

Masks as data or as positions: ``key_valid`` is an arbitrary per-key mask, DATA, so it must
travel (ppermuted with its K/V block round a ring, all-gathered by Ulysses). The static keyword
``num_valid`` says "keys at global index ≥ num_valid are padding" (global index over the
sequence split on the axis, ring major for USP): a function of positions, so every device
computes the mask of any block it holds from the block's source position (the ring block held
after j hops on device i came from device (i − j) mod n; ``axis_index``, no communication).
Both may be given; a key is then real only if both say so. Causal masks are positions too:
each device reads its tokens' global positions from ``layouts.positions`` (a static table
indexed by ``axis_index``), and the ring skips the (query tile, key chunk) pairs in which no
query sees a key (``ring_work`` counts what is left).

Padding: a token count that does not divide n is padded with ``pad_tokens`` before
``shard_map``; pass ``num_valid`` = the true token count (the communication-free path) so padded
keys get zero weight; the returned mask as ``key_valid`` is equivalent but travels. Padded
QUERY rows still produce outputs: drop them (slice back) or mask them before any reduction over
tokens. Mean pooling ("gap") over a padded, sharded sequence is sum(x · valid) over the local
tokens, ``psum`` over the seq axis, divided by the TRUE token count (not t_padded, not a
per-device count).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from shardkit.mesh import AXES, PlanError
from shardkit.parallel import layouts
from shardkit.parallel.collectives import shard_map_primitive

MASK_VALUE = float(np.float32(-0.7 * float(np.finfo(np.float32).max)))  # exact in float32
SEQ_RING = "seq_ring"
SEQ_ULYSSES = "seq_ulysses"
USP_SEQ = (SEQ_RING, SEQ_ULYSSES)
USP_AXES = ("data", SEQ_RING, SEQ_ULYSSES, "model")
ATTENTION_MODES = ("ring", "ulysses", "usp")
KEY_CHUNK = 512  # default most keys per chunk inside one ring hop (see attention_ring)

Block = Float[Array, "b t h k"]
KeyValid = Bool[Array, "b s"] | Bool[Array, " s"] | None
Segments = Int[Array, "b t"] | None
Lse = Float[Array, "b h t"]
# Running softmax state of one query block: max m [b,h,q], sum l [b,h,q], unnormalised acc
# [b,q,h,k]; all float32.
_Stats = tuple[Array, Array, Array]
# A key/value block with its key mask, for causal attention its keys' global positions, and
# for packed sequences its keys' segment ids: k, v [b, s, h_kv, k], key_valid [(b,) s] or None,
# key_pos [s] int32 or None, key_seg [b, s] int or None.
_KV = tuple[Array, Array, Array | None, Array | None, Array | None]


# The ring's data masks, which travel with their K/V block: (key_valid, segment_ids).
_Masks = tuple[Array | None, Array | None]


class _Queries(NamedTuple):
    """What the mask needs of a query block: global positions [t] (causal) and segment ids
    [b, t] (packed sequences), each None when unused."""

    pos: Array | None = None
    seg: Array | None = None

    def at(self, r: slice) -> _Queries:
        return _Queries(
            None if self.pos is None else self.pos[r], None if self.seg is None else self.seg[:, r]
        )


# inner(q, k, v, key_valid, segment_ids) on Ulysses-gathered tokens -> (out, lse)
_Attention = Callable[[Array, Array, Array, Array | None, Array | None], tuple[Array, Array]]


# ----------------------------------------------------------------------------- block math


def _check_blocks(
    q: Array, k: Array, v: Array, key_valid: Array | None, segment_ids: Array | None = None
) -> None:
    """Raises ValueError unless q [b,t,h,k], k = v [b,s,h_kv,k] with h_kv dividing h (grouped-
    query attention; h_kv = h is multi-head, 1 multi-query), key_valid [b,s] | [s] bool."""
    b, s, h_kv, d = k.shape if k.ndim == 4 else (None,) * 4
    if q.ndim != 4 or k.shape != v.shape or q.shape[0] != b or q.shape[3] != d:
        raise ValueError(
            f"attention needs q [b, t, h, k] and k, v [b, s, h_kv, k] blocks; got q {q.shape}, "
            f"k {k.shape}, v {v.shape}."
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"grouped-query attention needs the query heads ({q.shape[2]}) divisible by the "
            f"key/value heads ({h_kv})."
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}.")
    if key_valid is not None and (
        key_valid.dtype != jnp.bool_ or key_valid.shape not in ((b, s), (s,))
    ):
        raise ValueError(
            f"key_valid must be a bool array of shape [{b}, {s}] or [{s}]; "
            f"got {key_valid.dtype} {key_valid.shape}."
        )
    if segment_ids is not None and (
        not jnp.issubdtype(segment_ids.dtype, jnp.integer)
        or segment_ids.shape != (b, s)
        or q.shape[1] != s
    ):
        raise ValueError(
            f"segment_ids must be an integer array of shape [{b}, {s}] (one id per token of "
            f"equal query and key blocks); got {segment_ids.dtype} {segment_ids.shape} with "
            f"{q.shape[1]} queries."
        )


def _key_mask(key_valid: Array) -> Array:
    """[b, s] or [s] -> [b | 1, 1, 1, s], broadcastable against logits [b, h, q, s]."""
    valid = key_valid if key_valid.ndim == 2 else key_valid[None]
    return valid[:, None, None, :]


def _positions_valid(pos: Array, num_valid: int | None, total: int) -> Array | None:
    """valid[s] of the keys at global positions ``pos``: position < num_valid.

    Computed from positions alone (no communication); None when no key of any block is padding
    (``num_valid`` None or ≥ ``total``, the token count the blocks cover).
    """
    if num_valid is None or num_valid >= total:
        return None
    return pos < num_valid


def _and_valid(key_valid: Array | None, valid: Array | None) -> Array | None:
    """key_valid AND valid, either of them None (all True); [s] & [b, s] broadcasts to [b, s]."""
    if key_valid is None or valid is None:
        return valid if key_valid is None else key_valid
    return key_valid & (valid if key_valid.ndim == 1 else valid[None])


def _check_num_valid(num_valid: int | None) -> None:
    if num_valid is not None and (not isinstance(num_valid, int) or num_valid < 0):
        raise ValueError(f"num_valid must be a non-negative int or None; got {num_valid!r}.")


def _mask(
    key_valid: Array | None,
    queries: _Queries,
    key_pos: Array | None,
    key_seg: Array | None = None,
) -> Array | None:
    """The allowed (query, key) pairs, broadcastable to logits [b, h, q, s], or None (all).

    ``key_valid`` [(b,) s] masks keys; with global positions (causal) a query at position i
    sees the keys at positions ≤ i. Positions are computed on every device: nothing travels.
    """
    mask = None if key_valid is None else _key_mask(key_valid)
    if key_seg is not None and queries.seg is not None:  # packed: same segment only
        same = (queries.seg[:, :, None] == key_seg[:, None, :])[:, None]
        mask = same if mask is None else mask & same
    if key_pos is None or queries.pos is None:
        return mask
    causal = (queries.pos[:, None] >= key_pos[None, :])[None, None]
    return causal if mask is None else mask & causal


def _grouped(x: Array, kv_heads: int) -> Array:
    """[b, t, h, k] -> [b, t, n, g, k]: query heads grouped by the KV head they share (n of them;
    query head i uses KV head i // g)."""
    b, t, h, d = x.shape
    return x.reshape(b, t, kv_heads, h // kv_heads, d)


def _grouped_bh(x: Array, kv_heads: int) -> Array:
    """[b, h, q, s] -> [b, n, g, q, s] (the same grouping, for probabilities)."""
    b, h, *rest = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, *rest)


def _logits(q: Array, k: Array, mask: Array | None) -> Array:
    """Scaled float32 logits [b, h, q, s]; masked pairs get the finite MASK_VALUE."""
    b, t, h, d = q.shape
    scale = d**-0.5
    qg = _grouped(q, k.shape[2])
    s = jnp.einsum("bqngk,bsnk->bngqs", qg, k, preferred_element_type=jnp.float32) * scale
    s = s.reshape(b, h, t, k.shape[1])
    return s if mask is None else jnp.where(mask, s, MASK_VALUE)


def _probs(s: Array, shift: Array, mask: Array | None) -> Array:
    """exp(s − shift) with masked pairs exactly 0, so a row with no allowed key sums to 0."""
    p = jnp.exp(s - shift[..., None])
    return p if mask is None else jnp.where(mask, p, 0.0)


def _bhq_to_bqh(x: Array) -> Array:
    return jnp.swapaxes(x, 1, 2)


def _block_stats(q: Array, k: Array, v: Array, mask: Array | None) -> _Stats:
    """Softmax statistics of q against one K/V block (``mask``: see ``_mask``)."""
    s = _logits(q, k, mask)
    # The max only shifts exponents; out and lse do not depend on it, so no gradient flows.
    m = jax.lax.stop_gradient(s.max(-1))
    p = _probs(s, m, mask)
    pg = _grouped_bh(p.astype(v.dtype), v.shape[2])
    acc = jnp.einsum("bngqs,bsnk->bqngk", pg, v, preferred_element_type=jnp.float32)
    return m, p.sum(-1), acc.reshape(q.shape)


def _merge(a: _Stats, b: _Stats) -> _Stats:
    """Online-softmax merge of two blocks' statistics (rescale both to the larger max)."""
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
    m = jnp.maximum(m_a, m_b)
    w_a, w_b = jnp.exp(m_a - m), jnp.exp(m_b - m)
    acc = acc_a * _bhq_to_bqh(w_a)[..., None] + acc_b * _bhq_to_bqh(w_b)[..., None]
    return m, l_a * w_a + l_b * w_b, acc


def _finish(stats: _Stats, dtype: jnp.dtype) -> tuple[Array, Array]:
    """(out, lse) from final statistics; rows without a valid key give out 0, lse MASK_VALUE."""
    m, row_sum, acc = stats
    has_key = row_sum > 0
    l_safe = jnp.where(has_key, row_sum, 1.0)  # keeps log and division finite in value and gradient
    out = acc / _bhq_to_bqh(l_safe)[..., None]
    lse = jnp.where(has_key, m + jnp.log(l_safe), MASK_VALUE)
    return out.astype(dtype), lse


def _block_grads(
    q: Array, k: Array, v: Array, mask: Array | None, d_out: Array, lse: Array, delta: Array
) -> tuple[Array, Array, Array]:
    """Float32 (dq, dk, dv) of one K/V block, recomputing probabilities from the saved lse.

    delta [b, h, q] is rowsum(d_out · out) − d_lse, so ds = p · (dp − delta) also carries the
    gradient through lse (d lse / d s = p).
    """
    f32, n = jnp.float32, k.shape[2]
    p = _probs(_logits(q, k, mask), lse, mask)
    d_out_g = _grouped(d_out, n)
    pg = _grouped_bh(p.astype(d_out.dtype), n)
    # GQA: a KV head's gradient sums over the g query heads that share it.
    dv = jnp.einsum("bngqs,bqngk->bsnk", pg, d_out_g, preferred_element_type=f32)
    dp = jnp.einsum("bqngk,bsnk->bngqs", d_out_g, v, preferred_element_type=f32).reshape(p.shape)
    ds = p * (dp - delta[..., None]) * q.shape[-1] ** -0.5
    dsg = _grouped_bh(ds, n)
    dq = jnp.einsum("bngqs,bsnk->bqngk", dsg.astype(k.dtype), k, preferred_element_type=f32)
    dk = jnp.einsum(
        "bngqs,bqngk->bsnk", dsg.astype(q.dtype), _grouped(q, n), preferred_element_type=f32
    )
    return dq.reshape(q.shape), dk, dv


# ----------------------------------------------------------------------------- key chunks


def _chunk_size(s: int, key_chunk: int | None) -> int:
    """Keys per chunk c of an s-key block (the chunk size the ring's hops use).

    The fewest chunks of at most ``key_chunk`` keys (``KEY_CHUNK`` if None), evened out: padding
    the block to whole chunks then adds fewer keys than there are chunks.
    """
    limit = KEY_CHUNK if key_chunk is None else key_chunk
    if limit < 1:
        raise ValueError(f"key_chunk must be a positive number of keys; got {key_chunk}.")
    chunks = max(1, -(-s // limit))
    return max(1, -(-s // chunks))


def _tiles(s: int, key_chunk: int | None, causal: bool, layout: str, group: int) -> tuple[int, int]:
    """(keys per chunk, query tiles) of a ring block of s tokens.

    Causal zigzag: a block is 2·group contiguous runs of positions; tiling queries and keys
    along those runs lets every (query tile, key chunk) pair be wholly visible, partly visible
    (the diagonal) or wholly invisible — and the invisible ones, about half, are skipped.
    Otherwise one query tile (a contiguous block skips whole future blocks as it is).
    """
    runs = 2 * group if causal and layout == "zigzag" and s % (2 * group) == 0 else 1
    limit = KEY_CHUNK if key_chunk is None else key_chunk
    return _chunk_size(s, min(limit, s // runs) if limit >= 1 else limit), runs


def _key_chunks(
    k: Array,
    v: Array,
    key_valid: Array | None,
    key_pos: Array | None,
    key_seg: Array | None,
    chunk: int,
) -> _KV:
    """k, v [b, s, h, d] -> [n_c, b, c, h, d], key_valid [(b,) s] -> [n_c, (b,) c] and
    key_pos [s] -> [n_c, c], c = chunk.

    s is zero-padded to n_c · c; padded keys are masked (key_valid is then never None).
    """
    padded = k.shape[1] % chunk > 0
    (k, valid), (v, _) = pad_tokens(k, chunk), pad_tokens(v, chunk)
    if key_valid is not None:
        key_valid, _ = pad_tokens(key_valid, chunk, axis=-1)
    elif padded:
        key_valid = valid

    def split(x: Array, axis: int) -> Array:
        axis %= x.ndim
        return jnp.moveaxis(x.reshape(*x.shape[:axis], -1, chunk, *x.shape[axis + 1 :]), axis, 0)

    if key_pos is not None:  # padded keys sit in the far future: never visible, never kept
        far = np.iinfo(np.int32).max
        key_pos = jnp.pad(key_pos, (0, -key_pos.shape[0] % chunk), constant_values=far)
    if key_seg is not None:  # padded keys are masked by key_valid whatever their segment
        key_seg, _ = pad_tokens(key_seg, chunk, axis=-1)
    return (
        split(k, 1),
        split(v, 1),
        None if key_valid is None else split(key_valid, -1),
        None if key_pos is None else split(key_pos, 0),
        None if key_seg is None else split(key_seg, -1),
    )


def _unchunk(x: Array, s: int) -> Array:
    """[n_c, b, c, h, d] -> [b, s, h, d]: the inverse of ``_key_chunks``, padding dropped."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :s]


def _varying_as(x: Array, *like: Array | None) -> Array:
    """x typed varying over every mesh axis that one of ``like`` varies over.

    A scan carry must keep its type; one that starts as a constant (zeros) must already vary
    like the values the loop body merges into it (shard_map's check_vma).
    """
    axes = set().union(*(jax.typeof(y).mat.varying for y in like if y is not None))
    axes -= set(jax.typeof(x).mat.varying)
    return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def _no_stats(q: Array, kv: _KV) -> _Stats:
    """Statistics of no keys at all (max MASK_VALUE, sum 0, acc 0): merging into them is exact."""
    b, t, h, _ = q.shape
    m = jnp.full((b, h, t), MASK_VALUE, jnp.float32)
    stats = (m, jnp.zeros((b, h, t), jnp.float32), jnp.zeros(q.shape, jnp.float32))
    m, row_sum, acc = (_varying_as(x, q, *kv) for x in stats)
    return m, row_sum, acc


def _visible(queries: _Queries, key_pos: Array | None) -> Array | None:
    """Causal: does any query of the tile see any of its keys? (None: not causal, always.)"""
    q_pos = queries.pos
    return None if q_pos is None or key_pos is None else q_pos.max() >= key_pos.min()


def _query_slices(t: int, q_chunks: int) -> list[slice]:
    """The ``q_chunks`` equal slices of a t-query block (causal skipping's query tiles)."""
    size = t // q_chunks
    return [slice(i * size, (i + 1) * size) for i in range(q_chunks)]


def _attend_tile(stats: _Stats, q: Array, q_pos: _Queries, kv: _KV, chunk: int) -> _Stats:
    """``_attend`` for one query tile; causal key chunks it cannot see are skipped (lax.cond)."""

    def step(stats: _Stats, kv_chunk: _KV) -> tuple[_Stats, None]:
        k, v, valid, pos, seg = kv_chunk

        def compute(stats: _Stats) -> _Stats:
            return _merge(stats, _block_stats(q, k, v, _mask(valid, q_pos, pos, seg)))

        visible = _visible(q_pos, pos)
        if visible is None:
            return compute(stats), None
        return jax.lax.cond(visible, compute, lambda stats: stats, stats), None

    stats, _ = jax.lax.scan(step, stats, _key_chunks(*kv, chunk))
    return stats


def _attend(
    stats: _Stats, q: Array, q_pos: _Queries, kv: _KV, chunk: int, q_chunks: int = 1
) -> _Stats:
    """``stats`` merged with q's statistics against the block kv = (k, v, key_valid, key_pos).

    The keys are taken ``chunk`` at a time (online softmax), so one float32 logits tile
    [b, h, t_q, chunk] is alive, never the whole [b, h, t_q, s]. Causal: the queries are
    taken in ``q_chunks`` tiles and a (query tile, key chunk) pair with no visible key is
    skipped, not computed on a mask.
    """
    if q_chunks == 1:
        return _attend_tile(stats, q, q_pos, kv, chunk)
    m, row_sum, acc = stats
    tiles = [
        _attend_tile((m[..., r], row_sum[..., r], acc[:, r]), q[:, r], q_pos.at(r), kv, chunk)
        for r in _query_slices(q.shape[1], q_chunks)
    ]
    ms, sums, accs = zip(*tiles, strict=True)
    return jnp.concatenate(ms, -1), jnp.concatenate(sums, -1), jnp.concatenate(accs, 1)


def _attend_grads_tile(
    dq: Array,
    q: Array,
    q_pos: _Queries,
    kv: _KV,
    chunk: int,
    d_out: Array,
    lse: Array,
    delta: Array,
) -> tuple[Array, Array, Array]:
    """``_attend_grads`` for one query tile, skipping the key chunks it cannot see."""
    f32 = jnp.float32

    def step(dq: Array, kv_chunk: _KV) -> tuple[Array, tuple[Array, Array]]:
        k, v, valid, pos, seg = kv_chunk

        def compute(dq: Array) -> tuple[Array, tuple[Array, Array]]:
            mask = _mask(valid, q_pos, pos, seg)
            dq_c, dk_c, dv_c = _block_grads(q, k, v, mask, d_out, lse, delta)
            return dq + dq_c, (dk_c, dv_c)

        def skip(dq: Array) -> tuple[Array, tuple[Array, Array]]:
            like = (q, k, v, valid, pos, seg, *q_pos, d_out, lse, delta)
            zero = (_varying_as(jnp.zeros(x.shape, f32), *like) for x in (k, v))
            return dq, tuple(zero)  # type: ignore[return-value]

        visible = _visible(q_pos, pos)
        if visible is None:
            return compute(dq)
        return jax.lax.cond(visible, compute, skip, dq)

    dq, (dk, dv) = jax.lax.scan(step, dq, _key_chunks(*kv, chunk))
    s = kv[0].shape[1]
    return dq, _unchunk(dk, s), _unchunk(dv, s)


def _attend_grads(
    dq: Array,
    q: Array,
    q_pos: _Queries,
    kv: _KV,
    chunk: int,
    d_out: Array,
    lse: Array,
    delta: Array,
    q_chunks: int = 1,
) -> tuple[Array, Array, Array]:
    """(dq + q's float32 gradient from block kv, the block's dk, dv), ``chunk`` keys at a time.

    Per chunk: recompute p from lse, add its dq, emit its dk, dv (one [b, h, t_q, chunk] tile
    of p, dp, ds alive at a time). Query tiles and causal skips as in ``_attend``.
    """
    if q_chunks == 1:
        return _attend_grads_tile(dq, q, q_pos, kv, chunk, d_out, lse, delta)
    tiles = [
        _attend_grads_tile(
            dq[:, r], q[:, r], q_pos.at(r), kv, chunk, d_out[:, r], lse[..., r], delta[..., r]
        )
        for r in _query_slices(q.shape[1], q_chunks)
    ]
    dqs, dks, dvs = zip(*tiles, strict=True)
    return jnp.concatenate(dqs, 1), sum(dks[1:], dks[0]), sum(dvs[1:], dvs[0])


# ----------------------------------------------------------------------------- local


def attention_local(
    q: Block,
    k: Block,
    v: Block,
    key_valid: KeyValid = None,
    *,
    causal: bool = False,
    segment_ids: Segments = None,
) -> tuple[Block, Lse]:
    """Masked softmax attention on whole local blocks (no communication; plain autodiff).

    Args:
      q: queries [b, t, h, k]; k, v: keys and values [b, s, h, k] (same dtype as q).
      key_valid: bool [b, s] or [s], True for real keys; None means all keys are real.
      causal: query i sees keys 0..i only (positions from 0 in both blocks).
      segment_ids: int [b, t] (t = s) for packed sequences: a query sees only the keys of its
        own segment (ANDed with the other masks), or None.

    Returns:
      out [b, t, h, k] in q's dtype (zeros for a query with no valid key) and the float32
      log-sum-exp of its logits, lse [b, h, t] (MASK_VALUE for a query with no valid key).
    """
    _check_blocks(q, k, v, key_valid, segment_ids)
    q_pos, key_pos = (jnp.arange(x.shape[1]) if causal else None for x in (q, k))
    mask = _mask(key_valid, _Queries(q_pos, segment_ids), key_pos, segment_ids)
    return _finish(_block_stats(q, k, v, mask), q.dtype)


# ----------------------------------------------------------------------------- ring


def _ring_perm(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


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
    layout: tuple[str, int],
) -> tuple[Array, Array]:
    """(out, lse): K/V blocks travel the ring; each is attended ``chunk`` keys at a time."""
    key_valid, segment_ids = masks
    n = jax.lax.axis_size(axis)
    tiles = _tiles(k.shape[1], chunk, causal, *layout)[1]
    table = _ring_table(layout[0], n, layout[1], k.shape[1])
    block = functools.partial(
        _hop_block, axis=axis, num_valid=num_valid, causal=causal, table=table
    )
    q_pos = _ring_queries(axis, causal, table, segment_ids)
    attend = functools.partial(_attend, q=q, q_pos=q_pos, chunk=chunk, q_chunks=tiles)

    def hop(carry: tuple[_Stats, tuple], step: Array) -> tuple[tuple[_Stats, tuple], None]:
        stats, kv = carry
        # Pass the K/V block (with key_valid, segment ids if any) one step round the ring: after j
        # hops this device holds the block that started on device i − j.
        kv = jax.lax.ppermute(kv, axis, _ring_perm(n))
        return (attend(stats, kv=block(kv, step)), kv), None

    kv = (k, v, key_valid, segment_ids)
    stats = attend(_no_stats(q, block(kv, 0)), kv=block(kv, 0))
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
        q, k, v, (key_valid, segment_ids), axis, chunk, num_valid, causal, (layout, 1)
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
    layout: tuple[str, int],
) -> tuple[Array, Array]:
    return _ring_forward(q, k, v, masks, axis, chunk, num_valid, causal, layout)


def _ring_fwd(
    q: Array,
    k: Array,
    v: Array,
    masks: _Masks,
    axis: str,
    chunk: int,
    num_valid: int | None,
    causal: bool,
    layout: tuple[str, int],
) -> tuple[tuple[Array, Array], tuple]:
    out, lse = _ring_forward(q, k, v, masks, axis, chunk, num_valid, causal, layout)
    return (out, lse), (q, k, v, masks, out, lse)


def _ring_bwd(
    axis: str,
    chunk: int,
    num_valid: int | None,
    causal: bool,
    layout: tuple[str, int],
    res: tuple,
    cts: tuple[Array, Array],
) -> tuple:
    q, k, v, masks, out, lse = res
    key_valid, segment_ids = masks
    d_out, d_lse = cts
    f32 = jnp.float32
    delta = _bhq_to_bqh(jnp.sum(d_out.astype(f32) * out.astype(f32), -1)) - d_lse
    n = jax.lax.axis_size(axis)
    table = _ring_table(layout[0], n, layout[1], k.shape[1])
    q_pos = _ring_queries(axis, causal, table, segment_ids)
    tiles = _tiles(k.shape[1], chunk, causal, *layout)[1]
    grads = functools.partial(
        _attend_grads,
        q=q,
        q_pos=q_pos,
        chunk=chunk,
        d_out=d_out,
        lse=lse,
        delta=delta,
        q_chunks=tiles,
    )
    block = functools.partial(
        _hop_block, axis=axis, num_valid=num_valid, causal=causal, table=table
    )

    def hop(carry: tuple, step: Array) -> tuple[tuple, None]:
        dq, kv, dkv = carry
        # K, V (key_valid, segment ids if any) and their gradient accumulators travel together.
        kv, (dk, dv) = jax.lax.ppermute((kv, dkv), axis, _ring_perm(n))
        dq, dk_blk, dv_blk = grads(dq, kv=block(kv, step))
        return (dq, kv, (dk + dk_blk, dv + dv_blk)), None

    kv = (k, v, key_valid, segment_ids)
    dq = _varying_as(jnp.zeros(q.shape, f32), q, *block(kv, 0), d_out, lse, delta)
    dq, dk, dv = grads(dq, kv=block(kv, 0))
    if n > 1:
        (dq, _, (dk, dv)), _ = jax.lax.scan(hop, (dq, kv, (dk, dv)), jnp.arange(1, n))
        # n-th hop for dK, dV only: each accumulator returns to the device that owns its block.
        dk, dv = jax.lax.ppermute((dk, dv), axis, _ring_perm(n))
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

    Returns:
      out [b, t, h, k] (q's dtype) and lse [b, h, t] (float32), equal to attention over the
      whole sequence; see ``attention_local`` for rows without a valid key.
    """
    _check_ring(q, k, v, key_valid, num_valid, causal, segment_ids)
    chunk = _tiles(k.shape[1], key_chunk, causal, layout, 1)[0]
    masks = (key_valid, segment_ids)
    return _ring(q, k, v, masks, axis, chunk, num_valid, causal, (layout, 1))


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
) -> tuple[Block, Lse]:
    """``attention_ring`` whose blocks each hold ``group`` consecutive shards of ``layout``
    (USP's ring after its all-to-all over a Ulysses axis of size ``group``)."""
    _check_ring(q, k, v, key_valid, num_valid, causal, segment_ids)
    chunk = _tiles(k.shape[1], key_chunk, causal, layout, group)[0]
    masks = (key_valid, segment_ids)
    return _ring(q, k, v, masks, axis, chunk, num_valid, causal, (layout, group))


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

    Returns:
      out [b, t, h, k] and lse [b, h, t] as ``attention_local`` on the whole sequence.

    Raises:
      PlanError: (a ValueError) at trace time, when h is not divisible by n.
    """
    _check_num_valid(num_valid)

    def local(
        q: Array, k: Array, v: Array, key_valid: Array | None, segs: Array | None
    ) -> tuple[Array, Array]:
        # Every device now holds all s keys in device order: masks from positions alone.
        n, s = jax.lax.axis_size(axis), k.shape[1]
        pos = jnp.asarray(layouts.positions(layout, n, s // n).reshape(-1))
        valid = _and_valid(key_valid, _positions_valid(pos, num_valid, s))
        key_pos = pos if causal else None
        mask = _mask(valid, _Queries(key_pos, segs), key_pos, segs)
        return _finish(_block_stats(q, k, v, mask), q.dtype)

    return _ulysses(q, k, v, key_valid, segment_ids, axis, local)


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

    Returns:
      out [b, t, h, k] and lse [b, h, t] as ``attention_local`` on the whole sequence.
    """
    _check_num_valid(num_valid)
    u = jax.lax.axis_size(ulysses_axis)

    def ring(
        q: Array, k: Array, v: Array, key_valid: Array | None, segs: Array | None
    ) -> tuple[Array, Array]:
        return _attention_ring_grouped(
            q, k, v, key_valid, ring_axis, key_chunk, num_valid, causal, layout, u, segs
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
    """Splits a ``data × seq × model`` mesh's seq axis into ``seq_ring × seq_ulysses``.

    The device grid [data, seq, model] is reshaped to [data, seq/u, u, model] with axes
    ``USP_AXES``, so ``P(..., USP_SEQ, ...)`` here places every shard on the same device as
    ``P(..., "seq", ...)`` on ``mesh``; data-, model- and seq-sharded arrays carry over as is.
    """
    if tuple(mesh.axis_names) != AXES:
        raise PlanError(f"usp_mesh needs a mesh with axes {AXES}, got {mesh.axis_names}.")
    data, seq, model = mesh.devices.shape
    if ulysses < 1 or seq % ulysses:
        raise PlanError(f"Ulysses degree {ulysses} must divide the seq axis size {seq}.")
    grid = mesh.devices.reshape(data, seq // ulysses, ulysses, model)
    return Mesh(grid, USP_AXES, axis_types=(AxisType.Auto,) * len(USP_AXES))


# ----------------------------------------------------------------------------- global arrays


def pad_tokens(x: Array, multiple: int, axis: int = 1) -> tuple[Array, Bool[Array, " t"]]:
    """Zero-pads (False for bool) ``axis`` of ``x`` up to a multiple of ``multiple``.

    Use outside ``shard_map``. Returns the padded array and valid [t_padded], True on the
    original tokens. For the sequence-parallel attentions prefer ``num_valid=t`` (each device
    computes the padding mask from token positions and nothing travels); ``valid`` is for
    ``attention_local`` or to AND with a data mask passed as ``key_valid``. Pooling must divide
    by the true token count (see the module docstring).
    """
    axis %= x.ndim
    t = x.shape[axis]
    t_padded = -(-t // multiple) * multiple
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, t_padded - t)
    return jnp.pad(x, widths), jnp.arange(t_padded) < t


def _mode_plan(
    mesh: Mesh, mode: str, heads: int, ulysses: int | None, key_chunk: int | None
) -> tuple[Mesh, str | tuple[str, ...], Callable[..., tuple[Array, Array]]]:
    """(mesh to run on, the token spec entry, the per-device attention) for ``mode``."""
    if mode == "ring":
        return mesh, "seq", functools.partial(attention_ring, axis="seq", key_chunk=key_chunk)
    if mode == "ulysses":
        if key_chunk is not None:
            raise PlanError("key_chunk chunks a ring's hops; mode 'ulysses' has no ring.")
        return mesh, "seq", functools.partial(attention_ulysses, axis="seq")
    if mode != "usp":
        raise PlanError(f"Unknown attention mode {mode!r}; choose one of {ATTENTION_MODES}.")
    u = usp_factor(mesh.shape["seq"], heads // mesh.shape["model"], ulysses)
    attn = functools.partial(
        attention_usp, ulysses_axis=SEQ_ULYSSES, ring_axis=SEQ_RING, key_chunk=key_chunk
    )
    return usp_mesh(mesh, u), USP_SEQ, attn


def _padded_inputs(
    arrays: dict[str, Array | None], n: int, seq: str | tuple[str, ...], layout: str
) -> tuple[dict[str, Array], dict[str, P]]:
    """The given arrays (q, k, v, and key_valid / segment_ids if any) token-padded and permuted
    into ``layout``, and their in_specs; padding needs no mask array."""
    multiple = layouts.multiple(layout, n)
    args = {
        name: layouts.to_layout(pad_tokens(x, multiple)[0], n, layout)
        for name, x in arrays.items()
        if x is not None
    }
    specs = {
        name: P("data", seq, *(("model", None) if x.ndim == 4 else ())) for name, x in args.items()
    }
    return args, specs


def _check_global(q: Array, k: Array, mesh: Mesh) -> None:
    model = mesh.shape["model"]
    if q.shape[0] % mesh.shape["data"] or q.shape[2] % model or k.shape[2] % model:
        raise PlanError(
            f"Batch {q.shape[0]} must divide by data={mesh.shape['data']} and heads {q.shape[2]} "
            f"(key/value heads {k.shape[2]}) by model={model}."
        )


def sharded_attention(
    q: Float[Array, "b t h k"],
    k: Float[Array, "b s h k"],
    v: Float[Array, "b s h k"],
    mesh: Mesh,
    mode: str = "ring",
    key_valid: Bool[Array, "b s"] | None = None,
    *,
    ulysses: int | None = None,
    key_chunk: int | None = None,
    num_valid: int | None = None,
    causal: bool = False,
    layout: str = "contiguous",
    segment_ids: Int[Array, "b t"] | None = None,
) -> tuple[Float[Array, "b t h k"], Float[Array, "b h t"]]:
    """Sequence-parallel attention on global arrays: pads, runs ``shard_map``, slices back.

    Batch is split over ``data``, tokens over ``seq`` (padded to a multiple of its size) and
    heads over ``model``: q, k, v[B_data, T_seq, H_model, K] -> out[B_data, T_seq, H_model, K],
    lse[B_data, H_model, T_seq].

    Args:
      q: queries [b, t, h, k]; k, v: keys and values [b, s, h, k].
      mesh: a ``data × seq × model`` mesh from ``shardkit.mesh.make_mesh``.
      mode: "ring", "ulysses" or "usp" (the seq axis split by ``usp_mesh``).
      key_valid: optional bool [b, s], True for real keys (data: it travels).
      ulysses: the Ulysses degree for "usp" (None: ``usp_factor`` picks it).
      key_chunk: most keys per chunk in ring hops ("ring", "usp"; see ``attention_ring``).
      num_valid: keys at index ≥ num_valid are invalid, computed from positions (no
        communication). The padding added to reach a multiple of the seq axis size is always
        masked this way (num_valid at most s).
      causal: query i sees keys 0..i (global positions; the padding sits after every real
        token, so it changes no real query's keys). Needs t = s.
      layout: the token layout on the devices (``layouts.LAYOUTS``): the arrays are permuted
        into it before ``shard_map`` and back after, so results are in sequence order.
      segment_ids: optional int [b, t] (t = s) for packed sequences: a query sees only the
        keys of its own segment (data: it travels like ``key_valid``).

    Returns:
      out [b, t, h, k] and float32 lse [b, h, t], as ``attention_local`` on the whole arrays.
      A convenience for users and tests: when t does not divide, slicing the padded, seq-sharded
      results back makes XLA gather them outside ``shard_map``. Models should keep activations
      padded and call the ``attention_*`` functions inside their own ``shard_map``.
    """
    _check_global(q, k, mesh)
    _check_num_valid(num_valid)
    n, s = mesh.shape["seq"], k.shape[1]
    mesh, seq, attn = _mode_plan(mesh, mode, q.shape[2], ulysses, key_chunk)
    spec = P("data", seq, "model", None)
    given = {"q": q, "k": k, "v": v, "key_valid": key_valid, "segment_ids": segment_ids}
    args, in_specs = _padded_inputs(given, n, seq, layout)
    num_valid = s if num_valid is None else min(num_valid, s)

    def body(a: dict[str, Array]) -> tuple:
        return attn(
            a["q"],
            a["k"],
            a["v"],
            a.get("key_valid"),
            num_valid=num_valid,
            causal=causal,
            layout=layout,
            segment_ids=a.get("segment_ids"),
        )

    sharded = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(in_specs,),
        out_specs=(spec, P("data", "model", seq)),
        check_vma=True,
    )
    out, lse = sharded(args)
    out, lse = layouts.from_layout(out, n, layout), layouts.from_layout(lse, n, layout, axis=2)
    return out[:, : q.shape[1]], lse[..., : q.shape[1]]


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
