"""The pipeline's forwards alone (inference): ``pipeline_forward`` runs a schedule's F actions
inside ``shard_map`` over a stage axis, in the branch form or, when a chunk runs a
``ppermute``, the uniform form (the package docstring says both).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardkit.parallel.pipeline.engine import (
    EmbedFn,
    Row,
    StageFn,
    _check_shapes,
    _micro,
    _permute_axes_of,
    _pick,
    _stage_masks,
)
from shardkit.parallel.pipeline.schedules import Schedule
from shardkit.parallel.pipeline.tables import forward_tables, merged_branch
from shardkit.parallel.pipeline.writes import buffer, like, store
from shardkit.parallel.vma import tree_varying_axes, vary, vary_tree


def pipeline_forward(
    schedule: Schedule,
    stage_fn: StageFn,
    stage_params: Any,
    embed_fn: EmbedFn,
    embed_params: Any,
    head_fn: Callable[[Any, jax.Array], jax.Array],
    head_params: Any,
    inputs: Any,
    *,
    axis: str = "stage",
) -> jax.Array:
    """The schedule's forwards alone; call inside ``shard_map`` over ``axis``.

    ``head_fn(head_params, y) -> out`` runs after the last chunk (an inference head: logits).
    Returns out[M, ...] of every microbatch, the same on every stage (summed over ``axis``
    from the one device that holds the last chunk; the others contribute zeros).
    """
    _check_shapes(schedule, stage_params, inputs, None, axis)
    tab = forward_tables(schedule)
    act_axes = tree_varying_axes(inputs) | {axis}
    stage_params = vary_tree(stage_params, act_axes)
    embed_params = vary_tree(embed_params, act_axes)
    head_params = vary_tree(head_params, act_axes)
    x0 = vary(embed_fn(embed_params, jax.tree.map(lambda a: a[0], inputs)), act_axes)
    chunk0 = jax.tree.map(lambda a: a[0], stage_params)
    uniform = bool(_permute_axes_of(
        lambda p, x, ep, hp, i: (stage_fn(p, x), embed_fn(ep, i), head_fn(hp, x)),
        chunk0, x0, embed_params, head_params, jax.tree.map(lambda a: a[0], inputs),
    ))  # fmt: skip
    out0 = head_fn(head_params, stage_fn(chunk0, x0))
    act = jnp.zeros_like(x0)
    state = dict(
        x_box=buffer(tab.x_slots, act, 0.0),
        out=buffer(schedule.micro, vary(out0, act_axes), 0.0),
        recv=[act] * len(tab.x_pairs),  # what each permute delivered, stored next tick
    )
    stage = jax.lax.axis_index(axis)
    ends = (embed_fn, embed_params, head_fn, head_params)
    branches = _forward_branches(stage_fn, stage_params, ends, inputs, act)

    for start, stop, send in tab.segments():
        rows = tab.rows(start, stop)
        xs = {"rows": rows, "variant": _forward_variants(rows["branch"])}
        body = _tick(send, stage, uniform, branches, (axis, tab.x_pairs, act))
        state, _ = jax.lax.scan(body, state, jax.tree.map(jnp.asarray, xs))
    return jax.lax.psum(state["out"], axis)


def _tick(
    send: bool, stage: jax.Array, uniform: bool, branches: list[Callable[..., Any]],
    sending: tuple[str, Any, jax.Array],
) -> Callable[..., Any]:  # fmt: skip
    """One tick of the forwards: store what arrived, run the branch (uniform form: the tick's
    variant on every stage, masked by its own entry), send over each permute."""
    axis, pairs, act = sending

    def body(state: dict[str, Any], xs: dict[str, Any]) -> tuple[Any, None]:
        row = {k: v[stage] for k, v in xs["rows"].items()}
        state = dict(state)
        for k, value in enumerate(state["recv"]):
            state["x_box"] = store(state["x_box"], row["x_arrive"][k], value)
        if uniform:
            row, index = _stage_masks(row), xs["variant"]
        else:
            index = row["branch"]
        writes, out = jax.lax.switch(index, branches, state, row)
        for box, (slot, value) in writes.items():  # outside the switch: no whole-buffer copy
            state[box] = store(state[box], slot, value)
        state["recv"] = [jax.lax.ppermute(out, axis, p) if send else act for p in pairs]
        return state, None

    return body


def _forward_variants(branch: np.ndarray) -> np.ndarray:
    """Per tick of the forward tables, the branch every stage runs in the uniform form
    (``tables.merged_branch``: the forward tables' branches are ``branch_index``'s F ones)."""
    return np.array([merged_branch("F", row) for row in branch], np.int32).reshape(-1)


def _forward_branches(
    stage_fn: StageFn, stage_params: Any, ends: tuple[Any, ...], inputs: Any, act: jax.Array
) -> list[Callable[..., tuple[Any, jax.Array]]]:
    """``pipeline_forward``'s switch: idle, then F for each (first chunk, last chunk); each
    returns its stores ({buffer: (slot, value)}, slot −1: none) and what it sends, not the
    updated buffers (which ``lax.switch`` would copy whole every tick)."""
    embed_fn, embed_params, head_fn, head_params = ends

    def nothing(state: dict[str, Any], row: Row) -> dict[str, Any]:
        boxes = ("x_box", "out") if "x_local" in row else ("out",)
        return {b: (jnp.full_like(row["micro"], -1), jnp.zeros_like(state[b][0])) for b in boxes}

    def forward(first: bool, last: bool, state: dict[str, Any], row: Row) -> tuple[Any, Any]:
        writes = nothing(state, row)
        chunk = jax.tree.map(lambda a: a[row["virtual"]], stage_params)
        x = state["x_box"][jnp.maximum(row["x_in"], 0)]
        if first:
            x = _pick(row, "first", like(embed_fn(embed_params, _micro(inputs, row)), act), x)
        y = stage_fn(chunk, x)
        if "x_local" in row:  # ZBV's turn: the next chunk is on this stage
            writes["x_box"] = (row["x_local"], like(y, act))
        if not last:
            return writes, like(y, act)
        out = like(head_fn(head_params, y), state["out"])
        writes["out"] = (_pick(row, "last", row["micro"], jnp.int32(-1)), out)
        return writes, _pick(row, "last", act, like(y, act))

    return [lambda state, row: (nothing(state, row), act)] + [
        functools.partial(forward, first, last) for first in (False, True) for last in (False, True)
    ]
