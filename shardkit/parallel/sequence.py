"""Sequence-parallel attention: ring attention, Ulysses, their hybrid (USP), and token padding.

Every ``attention_*`` function runs INSIDE ``jax.shard_map`` on per-device blocks and takes the
names of the mesh axes it communicates over; ``sharded_attention`` wraps them for global arrays.
Three modules, one namespace: ``blockwise`` (the block math and ``attention_local``), ``ring``
(``attention_ring``, ``ring_work``) and this one (Ulysses, USP, the global wrapper), which
re-exports the others' public names.
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

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from shardkit.mesh import AXES, PlanError
from shardkit.parallel import layouts
from shardkit.parallel.blockwise import (
    KEY_CHUNK,
    MASK_VALUE,
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
    attention_local,
    pad_tokens,
)
from shardkit.parallel.collectives import shard_map_primitive
from shardkit.parallel.ring import (
    _attention_ring_grouped,
    attention_ring,
    attention_ring_autodiff,
    ring_work,
)

SEQ_RING = "seq_ring"
SEQ_ULYSSES = "seq_ulysses"
USP_SEQ = (SEQ_RING, SEQ_ULYSSES)
USP_AXES = ("data", "stage", SEQ_RING, SEQ_ULYSSES, "model")
ATTENTION_MODES = ("ring", "ulysses", "usp")
# inner(q, k, v, key_valid, segment_ids) on Ulysses-gathered tokens -> (out, lse)
_Attention = Callable[[Array, Array, Array, Array | None, Array | None], tuple[Array, Array]]

__all__ = [
    "ATTENTION_MODES",
    "KEY_CHUNK",
    "MASK_VALUE",
    "SEQ_RING",
    "SEQ_ULYSSES",
    "USP_AXES",
    "USP_SEQ",
    "attention_local",
    "attention_ring",
    "attention_ring_autodiff",
    "attention_ulysses",
    "attention_usp",
    "heads_to_seq",
    "pad_tokens",
    "ring_work",
    "seq_to_heads",
    "sharded_attention",
    "usp_factor",
    "usp_mesh",
]


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
    """Splits a ``data × stage × seq × model`` mesh's seq axis into ``seq_ring × seq_ulysses``.

    The device grid [data, stage, seq, model] is reshaped to [data, stage, seq/u, u, model]
    with axes ``USP_AXES``, so ``P(..., USP_SEQ, ...)`` here places every shard on the same
    device as ``P(..., "seq", ...)`` on ``mesh``; data-, model- and seq-sharded arrays carry
    over as is.
    """
    if tuple(mesh.axis_names) != AXES:
        raise PlanError(f"usp_mesh needs a mesh with axes {AXES}, got {mesh.axis_names}.")
    data, stage, seq, model = mesh.devices.shape
    if ulysses < 1 or seq % ulysses:
        raise PlanError(f"Ulysses degree {ulysses} must divide the seq axis size {seq}.")
    grid = mesh.devices.reshape(data, stage, seq // ulysses, ulysses, model)
    return Mesh(grid, USP_AXES, axis_types=(AxisType.Auto,) * len(USP_AXES))


# ----------------------------------------------------------------------------- global arrays


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
