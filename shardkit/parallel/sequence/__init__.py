"""Sequence-parallel attention: ring attention, Ulysses, their hybrid (USP), and token padding.

Every ``attention_*`` function runs INSIDE ``jax.shard_map`` on per-device blocks and takes the
names of the mesh axes it communicates over; ``sharded_attention`` wraps them for global arrays.
One package, one namespace (this ``__init__`` re-exports the public names):
``blockwise`` (the block math and ``attention_local``), ``ring`` (``attention_ring``,
``ring_work``), ``ulysses`` (Ulysses, USP, the USP mesh), ``layouts`` (contiguous, zigzag,
striped token orders) and ``modes`` (``sharded_attention``: a mode on global arrays).
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

from shardkit.parallel.sequence.blockwise import KEY_CHUNK, MASK_VALUE, attention_local, pad_tokens
from shardkit.parallel.sequence.modes import ATTENTION_MODES, sharded_attention
from shardkit.parallel.sequence.ring import attention_ring, attention_ring_autodiff, ring_work
from shardkit.parallel.sequence.ulysses import (
    SEQ_RING,
    SEQ_ULYSSES,
    USP_AXES,
    USP_SEQ,
    attention_ulysses,
    attention_usp,
    heads_to_seq,
    seq_to_heads,
    usp_factor,
    usp_mesh,
)

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
