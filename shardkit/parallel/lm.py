"""Decoder language-model pieces for ``shard_map`` bodies: RMSNorm, rotary embeddings at global
positions, packed-document positions, and the vocabulary split over the TP axis.

The vocabulary is the largest tensor of a modern LM (128k rows): Megatron splits it over the
tensor-parallel axis X in both places it appears, and never gathers the logits.

  vocab_embed           ids[B, T] · table[V_X, D] -> rows owned here, 0 elsewhere -> {U_X}
                        -> all-reduced x[B, T, D] (Megatron-SP, ``token_dim=1``: reduce-
                        scattered to x[B, T_X, D]). Backward: each device's table rows get
                        their own tokens' cotangents (no communication).
  vocab_logits          h[B, T, D] -> (enter the region) -> h · W[D, V_X] -> logits[B, T, V_X]
  vocab_cross_entropy   logits[B, T, V_X] · targets[B, T] -> loss[B, T]: the log-sum-exp from
                        a max (pmax) and a sum of exponentials (psum) over X, the target's
                        logit from the one device that owns it (psum): 3 reductions of
                        [B, T] floats instead of gathering [B, T, V]. Backward: softmax − onehot
                        on the local V_X block, no communication.

Padded targets: a negative target (``IGNORE``) is a pad, its loss and gradient are 0; divide by
``valid_count`` summed over the batch axes. Packed documents: ``document_positions`` restarts
positions at every document boundary (give RoPE these, computed on the global sequence before
any token layout is applied).

Rotary embeddings (Su et al. 2021, Llama's "rotate half" form) rotate q and k by angles of
their GLOBAL positions: under a sequence layout (zigzag, striped) a device's local index is not
its tokens' position; ``layouts.local_positions`` gives the right ones inside ``shard_map``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from shardkit.parallel.collectives import all_reduce, axis_index, shard_map_primitive
from shardkit.parallel.tensor import Rope, enter_tp, exit_tp

IGNORE = -1  # a padded target: any negative id is ignored


def rms_norm(x: Float[Array, "... d"], scale: Float[Array, " d"], eps: float = 1e-6) -> Array:
    """RMSNorm over the last (model) dim: per token, so any token split (sequence parallelism,
    Megatron-SP) needs no communication; ``scale``'s gradient is then partial per device and
    summed like any replicated weight's. Computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + scale.shape)).astype(
        x.dtype
    )


def apply_rope(
    x: Float[Array, "b t h k"], positions: Int[Array, "... t"], theta: float = 10000.0
) -> Array:
    """Rotary embedding of ``x`` at ``positions`` ([t] or [b, t]): pairs (x_i, x_{i+k/2})
    rotated by ``position · theta^(−2i/k)``. Float32 angles; returns x's dtype."""
    half = x.shape[-1] // 2
    if x.shape[-1] % 2:
        raise ValueError(f"RoPE needs an even head dim, got {x.shape[-1]}.")
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    pos = positions.astype(jnp.float32)
    pos = pos[None] if pos.ndim == 1 else pos  # [b or 1, t]
    angles = pos[:, :, None, None] * freqs[None, None, None, :]  # [b, t, 1, k/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rope(positions: Int[Array, "... t"], theta: float = 10000.0) -> Rope:
    """The ``rope`` hook of ``tensor.attention_tp``: q and k rotated at ``positions``, the
    global positions of the tokens the attention region holds."""
    return lambda q, k: (apply_rope(q, positions, theta), apply_rope(k, positions, theta))


def document_positions(segment_ids: Int[Array, "b t"]) -> Int[Array, "b t"]:
    """Positions that restart at 0 at each document of a packed row: token t's offset from the
    first token of its run of equal ``segment_ids``. Global sequence order (before a layout)."""
    t = segment_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
        axis=1,
    )
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    return index - first


def _owned(ids: Array, rows: int, axis: str | None) -> tuple[Array, Array]:
    """(local row of each id, whether this device owns it): device i holds rows i·V/n ..."""
    offset = 0 if axis is None else axis_index(axis) * rows
    local = ids - offset
    inside = (local >= 0) & (local < rows)
    return jnp.clip(local, 0, rows - 1), inside


@shard_map_primitive
def vocab_embed(
    ids: Int[Array, "b t"],
    table: Float[Array, "v d"],
    axis: str | None,
    *,
    token_dim: int | None = None,
) -> Float[Array, "b t d"]:
    """Token embedding with the vocabulary split over ``axis``: ``table[V_X, D]`` (device i
    holds rows i·V/n ... (i+1)·V/n − 1); ids [b, t] whole over ``axis`` (every token, also
    under Megatron-SP). Returns x[b, t, d] invariant over ``axis`` (``token_dim=1``:
    x[b, t/n, d], this device's token shard, by one reduce-scatter)."""
    if axis is None:
        return table[ids]
    local, inside = _owned(ids, table.shape[0], axis)
    rows = jnp.where(inside[..., None], table[local], jnp.zeros((), table.dtype))
    return exit_tp(rows, axis, token_dim=token_dim)


@shard_map_primitive
def vocab_logits(
    h: Float[Array, "b t d"],
    kernel: Float[Array, "d v"],
    axis: str | None,
    *,
    token_dim: int | None = None,
) -> Float[Array, "b t v"]:
    """The output head with the vocabulary split: h[b, t, d] (invariant over ``axis``; or
    [b, t/n, d] with ``token_dim=1``, gathered first) · ``kernel[D, V_X]`` -> this device's
    logits [b, t, v/n]. Tied to a split embedding: pass ``table.T``."""
    h = enter_tp(h, axis, token_dim=token_dim)
    return jnp.einsum("btd,dv->btv", h, kernel.astype(h.dtype))


@shard_map_primitive
def vocab_cross_entropy(
    logits: Float[Array, "b t v"], targets: Int[Array, "b t"], axis: str | None
) -> Float[Array, "b t"]:
    """Per-token cross-entropy of logits split over ``axis`` along the vocabulary (this
    device's [b, t, V/n] block), never gathered; float32, invariant over ``axis``. Targets are
    global ids, whole over ``axis``; a negative target (``IGNORE``) is a pad: loss 0, gradient 0.
    """
    x = logits.astype(jnp.float32)
    local, inside = _owned(targets, x.shape[-1], axis)
    # The max only stabilises the exponentials: no gradient flows through it.
    m = jax.lax.stop_gradient(x.max(axis=-1))
    if axis is not None:
        m = jax.lax.pmax(m, axis)
    sum_exp = jnp.exp(x - m[..., None]).sum(axis=-1)
    picked = jnp.where(inside, jnp.take_along_axis(x, local[..., None], -1)[..., 0], 0.0)
    if axis is not None:  # one device owns each target; every device holds a share of Σ exp
        sum_exp, picked = all_reduce(sum_exp, axis), all_reduce(picked, axis)
    loss = m + jnp.log(sum_exp) - picked
    return jnp.where(targets >= 0, loss, 0.0)


def valid_count(targets: Int[Array, "*dims"]) -> Array:
    """The number of real (non-pad) targets in this block, float32: sum it over the batch and
    sequence axes to get the mean's denominator."""
    return (targets >= 0).sum().astype(jnp.float32)


__all__ = [
    "IGNORE",
    "apply_rope",
    "document_positions",
    "rms_norm",
    "rope",
    "valid_count",
    "vocab_cross_entropy",
    "vocab_embed",
    "vocab_logits",
]
