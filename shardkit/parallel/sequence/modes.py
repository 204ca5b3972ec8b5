"""Sequence parallelism on global arrays: pick a mode, pad, permute into a layout, shard_map.

``sharded_attention(q, k, v, mesh, mode)`` is the convenience entry for users and tests: it
pads the tokens to the layout's multiple, permutes them into the layout, runs the mode's
per-device attention (``attention_ring``, ``attention_ulysses``, ``attention_usp``) inside
``jax.shard_map`` and slices the results back into sequence order. Models keep activations
padded and call the per-device functions inside their own ``shard_map``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from shardkit.mesh import PlanError
from shardkit.parallel.sequence import layouts
from shardkit.parallel.sequence.blockwise import _check_num_valid, pad_tokens
from shardkit.parallel.sequence.ring import attention_ring
from shardkit.parallel.sequence.ulysses import (
    SEQ_RING,
    SEQ_ULYSSES,
    USP_SEQ,
    attention_ulysses,
    attention_usp,
    usp_factor,
    usp_mesh,
)

ATTENTION_MODES = ("ring", "ulysses", "usp")


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


def _check_global(q: Array, k: Array, mesh: Mesh, num_valid: int | None) -> None:
    _check_num_valid(num_valid)
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
    kernel: str = "auto",
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
      ulysses: the Ulysses degree for "usp" (None: ``usp_factor`` picks it); key_chunk: most
        keys per chunk in ring hops ("ring", "usp"; see ``attention_ring``).
      num_valid: keys at index ≥ num_valid are invalid, computed from positions (no
        communication). The padding added to reach a multiple of the seq axis size is always
        masked this way (num_valid at most s).
      causal: query i sees keys 0..i (global positions; the padding sits after every real
        token, so it changes no real query's keys). Needs t = s.
      layout: the token layout on the devices (``layouts.LAYOUTS``): the arrays are permuted
        into it before ``shard_map`` and back after, so results are in sequence order.
      segment_ids: optional int [b, t] (t = s) for packed sequences: a query sees only the
        keys of its own segment (data: it travels like ``key_valid``).
      kernel: the per-device compute, "auto", "jnp" or "pallas" (see ``attention_ring``).

    Returns:
      out [b, t, h, k] and float32 lse [b, h, t], as ``attention_local`` on the whole arrays.
      A convenience for users and tests (slicing padded, seq-sharded results makes XLA gather
      them); models keep activations padded and call ``attention_*`` in their shard_map.
    """
    _check_global(q, k, mesh, num_valid)
    n, s = mesh.shape["seq"], k.shape[1]
    mesh, seq, attn = _mode_plan(mesh, mode, q.shape[2], ulysses, key_chunk)
    given = dict(q=q, k=k, v=v, key_valid=key_valid, segment_ids=segment_ids)
    args, in_specs = _padded_inputs(given, n, seq, layout)
    num_valid = s if num_valid is None else min(num_valid, s)
    opts = dict(num_valid=num_valid, causal=causal, layout=layout, kernel=kernel)

    def body(a: dict[str, Array]) -> tuple:
        key_valid, segs = a.get("key_valid"), a.get("segment_ids")
        return attn(a["q"], a["k"], a["v"], key_valid, segment_ids=segs, **opts)

    out_specs = (P("data", seq, "model", None), P("data", "model", seq))
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs)
    return _in_sequence_order(sharded(args), n, layout, q.shape[1])


def _in_sequence_order(
    results: tuple[Array, Array], n: int, layout: str, tokens: int
) -> tuple[Array, Array]:
    """(out, lse) permuted back from ``layout`` and sliced to the true ``tokens``."""
    out, lse = results
    out, lse = layouts.from_layout(out, n, layout), layouts.from_layout(lse, n, layout, axis=2)
    return out[:, :tokens], lse[..., :tokens]
