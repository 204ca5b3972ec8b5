"""How a pipeline tick changes the engine's buffers: a branch returns its ``Writes`` (per
buffer a slot and values, per accumulator what to add; ``no_writes``) and ``apply`` makes
them after the ``lax.switch``, so no buffer passes through a branch (XLA's copy insertion
copies whole every buffer a switch takes in and hands back). Also the buffer helpers the
engine and ``forward`` share.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from shardkit.parallel.pipeline.tables import KIND_INDEX
from shardkit.parallel.vma import vary, varying_axes

Writes = dict[str, Any]
Row = dict[str, jax.Array]

F, B, W = (KIND_INDEX[k] for k in "FBW")  # ``branch_parts``'s kind indices


def no_writes(state: dict[str, Any], row: Row, kinds: frozenset[int]) -> Writes:
    """What a branch hands ``apply``, as a branch that writes nothing: per buffer a (slot,
    values) store at slot −1, zeros to add to each accumulator; the chunk gradients' entry
    is (chunk index, zeros); only what some kind of action in the switch (``kinds``) writes.
    A branch returns its results this way rather than the updated state: a buffer passed
    through a ``lax.switch`` and out again is copied whole every tick (XLA's copy insertion:
    the identity branch aliases it), the stash and the gradients too."""
    nothing = jnp.full_like(row["micro"], -1)

    def stores(buffers: list[jax.Array]) -> tuple[jax.Array, list[jax.Array]]:
        return nothing, [jnp.zeros_like(b[0]) for b in buffers]

    writes: Writes = {}
    if F in kinds:
        writes.update(stash=stores(state["stash"]), dy_box=stores([state["dy_box"]]))
        writes.update({k: jax.tree.map(jnp.zeros_like, state[k]) for k in F_SUMS})
        if "x_local" in row:  # ZBV's turn
            writes["x_box"] = stores([state["x_box"]])
    if B in kinds and "dy_local" in row:  # ZBV's turn
        writes["dy_box"] = stores([state["dy_box"]])
    if B in kinds and "w_stash" in state:
        writes["w_stash"] = stores(state["w_stash"])
    if W in kinds or (B in kinds and "w_stash" not in state):
        per_chunk = jax.tree.map(lambda a: jnp.zeros_like(a[0]), state["grads"])
        writes.update(grads=(jnp.zeros_like(row["micro"]), per_chunk))
        writes["embed_grads"] = jax.tree.map(jnp.zeros_like, state["embed_grads"])
    return writes


F_SUMS = ("loss_grads", "loss", "metrics")  # accumulators an F adds to


def apply(state: dict[str, Any], writes: Writes) -> dict[str, Any]:
    """state with a branch's ``writes`` applied (``no_writes`` says what they hold)."""
    state = dict(state)
    for box in ("stash", "w_stash", "x_box", "dy_box"):
        if box in writes:
            slot, values = writes[box]
            buffers = state[box] if isinstance(state[box], list) else [state[box]]
            stored = [store(b, slot, v) for b, v in zip(buffers, values, strict=True)]
            state[box] = stored if isinstance(state[box], list) else stored[0]
    if "grads" in writes:
        chunk, dp = writes["grads"]
        state["grads"] = jax.tree.map(lambda acc, g: acc.at[chunk].add(g), state["grads"], dp)
    for k in ("embed_grads", *F_SUMS):
        if k in writes:
            state[k] = add(state[k], writes[k])
    return state


def zeros_over(tree: Any, axes: frozenset[str]) -> Any:
    """Zeros like ``tree`` (None: None), typed varying over its own axes and ``axes``."""
    return jax.tree.map(lambda a: vary(jnp.zeros_like(a), varying_axes(a) | axes), tree)


def add(acc: Any, grads: Any) -> Any:
    return jax.tree.map(lambda a, g: a + like(g, a), acc, grads)


def typed(tree: Any, ref: Any) -> Any:
    """``tree`` with each leaf cast to its counterpart's dtype and axes in ``ref``."""
    return jax.tree.map(like, tree, ref)


def store(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """buffer with ``value`` at ``slot``; unchanged where slot < 0."""
    index = jnp.maximum(slot, 0)
    value = jnp.where(slot >= 0, like(value, buffer), buffer[index])
    return jax.lax.dynamic_update_index_in_dim(buffer, value, index, 0)


def like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """x cast to ref's dtype and typed varying over (at least) ref's axes."""
    return vary(x.astype(ref.dtype), varying_axes(ref))


def buffer(slots: int, proto: jax.Array, fill: float) -> jax.Array:
    """[slots, *proto.shape] of ``fill`` (integer residuals: 0), typed like ``proto``."""
    value = fill if jnp.issubdtype(proto.dtype, jnp.floating) else 0
    return vary(jnp.full((slots, *proto.shape), value, proto.dtype), varying_axes(proto))
