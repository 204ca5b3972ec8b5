"""Blockwise softmax attention: the math every sequence-parallel attention shares.

One K/V block at a time (flash-attention style, float32 statistics whatever the input dtype):

  masks        ``key_valid`` (data), causal positions, packed-sequence segments -> ``_mask``
  one block    ``_block_stats`` (max, sum, unnormalised output) and ``_block_grads`` (dq, dk,
               dv recomputed from the saved lse), grouped-query heads included
  merging      ``_merge`` (online softmax), ``_finish`` (out, lse; rows with no key give 0)
  tiling       keys ``chunk`` at a time (``_key_chunks``), queries in tiles, causal skips
               (``_attend``, ``_attend_grads``)

``attention_local`` is the one public function here: masked attention on whole local blocks.
``ring`` and ``sequence`` build on the private helpers (this package's internal API). Shapes,
masks and the MASK_VALUE convention: see ``shardkit.parallel.sequence``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from shardkit import kernels
from shardkit.parallel.vma import vary_like

MASK_VALUE = float(np.float32(-0.7 * float(np.finfo(np.float32).max)))  # exact in float32
KEY_CHUNK = 512  # default most keys per chunk inside one ring hop (see ring.attention_ring)

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


def _no_stats(q: Array, kv: _KV) -> _Stats:
    """Statistics of no keys at all (max MASK_VALUE, sum 0, acc 0): merging into them is exact."""
    b, t, h, _ = q.shape
    m = jnp.full((b, h, t), MASK_VALUE, jnp.float32)
    stats = (m, jnp.zeros((b, h, t), jnp.float32), jnp.zeros(q.shape, jnp.float32))
    m, row_sum, acc = (vary_like(x, q, *kv) for x in stats)
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
            zero = (vary_like(jnp.zeros(x.shape, f32), *like) for x in (k, v))
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
    kernel: str = "auto",
) -> tuple[Block, Lse]:
    """Masked softmax attention on whole local blocks (no communication).

    Args:
      q: queries [b, t, h, k]; k, v: keys and values [b, s, h, k] (same dtype as q).
      key_valid: bool [b, s] or [s], True for real keys; None means all keys are real.
      causal: query i sees keys 0..i only (positions from 0 in both blocks).
      segment_ids: int [b, t] (t = s) for packed sequences: a query sees only the keys of its
        own segment (ANDed with the other masks), or None.
      kernel: "jnp" (this module's math, plain autodiff), "pallas" (``shardkit.kernels``:
        splash attention with its own backward; Pallas' interpreter off a TPU) or "auto"
        (Pallas on a TPU backend, else jnp).

    Returns:
      out [b, t, h, k] in q's dtype (zeros for a query with no valid key) and the float32
      log-sum-exp of its logits, lse [b, h, t] (MASK_VALUE for a query with no valid key).
    """
    _check_blocks(q, k, v, key_valid, segment_ids)
    if kernels.resolve_kernel(kernel, k.shape[1]) == "pallas":
        hop = kernels.local_mask(q.shape[1], k.shape[1], causal)
        return kernels.attend(q, k, v, hop, segment_ids, segment_ids, key_valid, None)
    q_pos, key_pos = (jnp.arange(x.shape[1]) if causal else None for x in (q, k))
    mask = _mask(key_valid, _Queries(q_pos, segment_ids), key_pos, segment_ids)
    return _finish(_block_stats(q, k, v, mask), q.dtype)


# ----------------------------------------------------------------------------- padding


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
