"""The pipeline engine: runs any ``schedules.Schedule`` inside ``shard_map`` over a stage axis.

Model-agnostic: a chunk is any ``stage_fn(chunk_params, x) -> y`` with y shaped like x, and
the last chunk's output feeds ``loss_fn(loss_params, y, target) -> scalar``. Per device s of
the ``stage`` axis (S devices, V chunks each: chunk v·S + s):

  stage_params[V, ...]   this device's chunks      inputs[M, ...]  chunk 0's input per microbatch
  loss_params            replicated                targets[M, ...] loss_fn's target per microbatch

``pipeline_grads`` scans the schedule's ticks. Each tick a device runs its table entry:

  F  y, vjp = jax.vjp(stage_fn, p[v], x): x from ``inputs`` (chunk 0) or the inbox; the vjp's
     residuals (all but the params, which stay where they are) go to a stash slot; y is sent
     to the next stage (``ppermute`` +1); on the last chunk the loss and dy = ∂loss/∂y are
     computed at once and dy goes to this device's own cotangent inbox.
  B  the vjp rebuilt from the stash, applied to dy from the inbox: dx is sent to the previous
     stage (−1), or is chunk 0's input gradient; unsplit schedules accumulate dp here.
  W  (split schedules) the same vjp, for dp only: XLA drops the unused half of each branch,
     so B computes only the input gradient and W only the weight gradient.

Buffers hold only what the schedule keeps in flight: stash, activation inbox and cotangent
inbox each have as many slots as the busiest stage's largest number of simultaneously live
entries (``Tables``; slots assigned statically by interval colouring), so 1F1B's stash has S
slots whatever M is, while GPipe's has M. Idle ticks run no computation at all (``lax.switch``
to an identity branch); every buffer starts at zeros, so nothing uninitialised is ever read.
Sends happen only in the runs of ticks where some stage sends (the scan is split into such
segments): per tick in a segment one ``ppermute`` of one activation [microbatch] each way used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardkit.parallel.schedules import Schedule

StageFn = Callable[[Any, jax.Array], jax.Array]
LossFn = Callable[[Any, jax.Array, Any], jax.Array]

IDLE, FORWARD, FORWARD_LAST, BACKWARD, WEIGHTS = range(5)


# ----------------------------------------------------------------------------- static tables


@dataclasses.dataclass(frozen=True)
class Tables:
    """The schedule as int32 arrays [ticks, S] the engine scans, and its buffer sizes.

    branch: IDLE / FORWARD / FORWARD_LAST / BACKWARD / WEIGHTS; micro, virtual: the action's
    microbatch and chunk-on-device; stash, x_in, dy_in: the slot the action reads or writes
    (−1: none); x_arrive, dy_arrive: the slot the value received at this tick's start is
    stored in (−1: nothing arrives). sends_x / sends_dy [ticks]: some stage sends.
    """

    branch: np.ndarray
    micro: np.ndarray
    virtual: np.ndarray
    stash: np.ndarray
    x_in: np.ndarray
    dy_in: np.ndarray
    x_arrive: np.ndarray
    dy_arrive: np.ndarray
    sends_x: np.ndarray
    sends_dy: np.ndarray
    stash_slots: int
    x_slots: int
    dy_slots: int

    def rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
        names = ("branch", "micro", "virtual", "stash", "x_in", "dy_in", "x_arrive", "dy_arrive")
        return {name: getattr(self, name)[start:stop] for name in names}

    def segments(self) -> list[tuple[int, int, bool, bool]]:
        """Runs (start, stop, sends_x, sends_dy) of ticks with the same send pattern."""
        out: list[tuple[int, int, bool, bool]] = []
        for tick, key in enumerate(zip(self.sends_x.tolist(), self.sends_dy.tolist())):
            if out and (out[-1][2], out[-1][3]) == key:
                out[-1] = (out[-1][0], tick + 1, *key)
            else:
                out.append((tick, tick + 1, *key))
        return out


def tables(schedule: Schedule) -> Tables:
    """Compiles a schedule into the engine's tables (slots by interval colouring per stage)."""
    S, C, T = schedule.stages, schedule.chunks, schedule.ticks
    when: dict[tuple[str, int, int], int] = {}
    for tick, row in enumerate(schedule.grid):
        for stage, a in enumerate(row):
            if a is not None:
                when[(a.kind, a.virtual * S + stage, a.micro)] = tick
    last_use = "W" if schedule.split else "B"
    stash, x_box, dy_box = {}, {}, {}  # (chunk, micro) -> (stage, first tick, last tick)
    for (kind, c, m), tick in when.items():
        if kind != "F":
            continue
        stash[(c, m)] = (c % S, tick, when[(last_use, c, m)])
        if c > 0:  # arrives the tick after F on the previous chunk
            x_box[(c, m)] = (c % S, when[("F", c - 1, m)] + 1, tick)
        start = tick if c == C - 1 else when[("B", c + 1, m)] + 1
        dy_box[(c, m)] = (c % S, start, when[(last_use, c, m)])
    slots = {name: _colour(box) for name, box in (("stash", stash), ("x", x_box), ("dy", dy_box))}

    def table(fill: int = -1) -> np.ndarray:
        return np.full((T, S), fill, np.int32)

    t = {k: table() for k in ("stash", "x_in", "dy_in", "x_arrive", "dy_arrive")}
    branch, micro, virtual = table(IDLE), table(0), table(0)
    for (kind, c, m), tick in when.items():
        s, v = c % S, c // S
        micro[tick, s], virtual[tick, s] = m, v
        branch[tick, s] = {"F": FORWARD, "B": BACKWARD, "W": WEIGHTS}[kind]
        if kind == "F" and c == C - 1:
            branch[tick, s] = FORWARD_LAST
        t["stash"][tick, s] = slots["stash"][(c, m)]
        t["dy_in"][tick, s] = slots["dy"][(c, m)]
        if kind == "F" and c > 0:
            t["x_in"][tick, s] = slots["x"][(c, m)]
    for (c, m), (s, start, _) in x_box.items():
        t["x_arrive"][start, s] = slots["x"][(c, m)]
    for (c, m), (s, start, _) in dy_box.items():
        if c < C - 1:
            t["dy_arrive"][start, s] = slots["dy"][(c, m)]
    sends_x = np.zeros(T, bool)
    sends_dy = np.zeros(T, bool)
    for (kind, c, _m), tick in when.items():
        sends_x[tick] |= kind == "F" and c < C - 1
        sends_dy[tick] |= kind == "B" and c > 0
    sizes = {name: 1 + max(v.values(), default=0) for name, v in slots.items()}
    return Tables(branch, micro, virtual, t["stash"], t["x_in"], t["dy_in"], t["x_arrive"],
                  t["dy_arrive"], sends_x, sends_dy, sizes["stash"], sizes["x"], sizes["dy"])  # fmt: skip


def _colour(intervals: dict[Any, tuple[int, int, int]]) -> dict[Any, int]:
    """Slot per key: per stage, closed [first, last] tick intervals sharing a slot never meet."""
    slots: dict[Any, int] = {}
    free_at: dict[int, list[int]] = {}  # stage -> per slot, the last tick it is busy
    for key, (stage, first, last) in sorted(intervals.items(), key=lambda kv: kv[1][1]):
        busy = free_at.setdefault(stage, [])
        slot = next((i for i, end in enumerate(busy) if end < first), len(busy))
        if slot == len(busy):
            busy.append(last)
        busy[slot] = last
        slots[key] = slot
    return slots


# ----------------------------------------------------------------------------- the engine


def pipeline_grads(
    schedule: Schedule,
    stage_fn: StageFn,
    loss_fn: LossFn,
    stage_params: Any,
    loss_params: Any,
    inputs: jax.Array,
    targets: Any,
    *,
    axis: str = "stage",
) -> tuple[jax.Array, Any, Any, jax.Array]:
    """Runs ``schedule`` forward and backward; call inside ``shard_map`` over ``axis``.

    Args:
      schedule: from ``schedules.build``; its S must equal the size of ``axis``.
      stage_fn: ``(chunk_params, x[...]) -> y[...]``, y shaped and typed like x.
      loss_fn: ``(loss_params, y, target) -> scalar`` for one microbatch.
      stage_params: this device's V chunks, every leaf stacked [V, ...].
      loss_params: replicated over ``axis`` (e.g. a final norm and head).
      inputs: [M, ...] chunk 0's input per microbatch (read on the first stage only).
      targets: pytree of [M, ...] (read on the last stage only).

    Returns:
      (loss, d_stage_params, d_loss_params, d_inputs): Σ_m loss invariant over ``axis``; the
      gradient of that sum for this device's chunks [V, ...]; for ``loss_params`` (invariant);
      and d_inputs[M, ...], the input cotangents, nonzero on the first stage only.
    """
    n = jax.lax.axis_size(axis)
    if n != schedule.stages:
        raise ValueError(
            f"The schedule has {schedule.stages} stages but the {axis!r} axis has {n} devices."
        )
    tab = tables(schedule)
    stage = jax.lax.axis_index(axis)
    # Activations vary over the inputs' axes and the stage; params are cast to vary over those
    # too (their gradients are partial sums there: no collective inside a branch).
    act = _vary(jnp.zeros_like(inputs[0]), _vma(inputs) | {axis})
    act_axes = _axes_of(act)
    stage_params = _vary_tree(stage_params, act_axes)
    loss_params = _vary_tree(loss_params, act_axes)
    chunk0 = jax.tree.map(lambda a: a[0], stage_params)
    y0, proto = jax.vjp(stage_fn, chunk0, act)
    if _axes_of(y0) != act_axes or y0.shape != act.shape:
        raise ValueError(
            f"stage_fn must map x {act.shape} varying over {sorted(act_axes)} to the same shape "
            f"and axes, got {y0.shape} varying over {sorted(_axes_of(y0))}."
        )
    res_def, keep = _residual_layout(proto, chunk0)
    stash = [_buffer(tab.stash_slots, leaf, axis) for leaf, k in zip(res_def[1], keep) if k < 0]
    state = dict(
        stash=stash,
        x_box=_buffer(tab.x_slots, act, axis),
        dy_box=_buffer(tab.dy_slots, act, axis),
        grads=jax.tree.map(jnp.zeros_like, stage_params),
        loss_grads=jax.tree.map(jnp.zeros_like, loss_params),
        loss=_vary(jnp.zeros((), jnp.float32), _vma(act)),
        d_inputs=_vary(jnp.zeros_like(inputs), _vma(act)),
        recv_x=act,
        recv_dy=act,
    )
    ctx = _Context(schedule, stage_fn, loss_fn, stage_params, loss_params, inputs, targets,
                   axis, stage, res_def[0], keep)  # fmt: skip
    for start, stop, send_x, send_dy in tab.segments():
        rows = {k: jnp.asarray(v) for k, v in tab.rows(start, stop).items()}
        body = _tick_body(ctx, send_x, send_dy)
        state, _ = jax.lax.scan(body, state, rows)
    loss = jax.lax.psum(state["loss"], axis)
    loss_grads = jax.lax.psum(state["loss_grads"], axis)
    return loss, state["grads"], loss_grads, state["d_inputs"]


@dataclasses.dataclass(frozen=True)
class _Context:
    schedule: Schedule
    stage_fn: StageFn
    loss_fn: LossFn
    stage_params: Any
    loss_params: Any
    inputs: jax.Array
    targets: Any
    axis: str
    stage: jax.Array
    vjp_def: Any
    keep: tuple[int, ...]  # per vjp leaf: chunk param index, or −1 (stashed)


def _tick_body(ctx: _Context, send_x: bool, send_dy: bool) -> Callable[..., Any]:
    S, V = ctx.schedule.stages, ctx.schedule.virtual
    circular = V > 1
    forward_pairs = [(s, (s + 1) % S) for s in range(S if circular else S - 1)]
    backward_pairs = [(d, s) for s, d in forward_pairs]

    def body(state: dict[str, Any], rows: dict[str, jax.Array]) -> tuple[dict[str, Any], None]:
        row = {k: v[ctx.stage] for k, v in rows.items()}
        state = dict(state)
        state["x_box"] = _store(state["x_box"], row["x_arrive"], state["recv_x"])
        state["dy_box"] = _store(state["dy_box"], row["dy_arrive"], state["recv_dy"])
        branches = [_idle, _forward, _forward_last, _backward, _weights]
        state, out_x, out_dy = jax.lax.switch(
            row["branch"], [lambda st, r, b=b: b(ctx, st, r) for b in branches], state, row
        )
        zeros = jnp.zeros_like(state["recv_x"])
        state["recv_x"] = jax.lax.ppermute(out_x, ctx.axis, forward_pairs) if send_x else zeros
        state["recv_dy"] = (
            jax.lax.ppermute(out_dy, ctx.axis, backward_pairs) if send_dy else zeros
        )
        return state, None

    return body


Branch = tuple[dict[str, Any], jax.Array, jax.Array]


def _idle(ctx: _Context, state: dict[str, Any], row: dict[str, jax.Array]) -> Branch:
    zeros = jnp.zeros_like(state["recv_x"])
    return state, zeros, zeros


def _chunk(ctx: _Context, row: dict[str, jax.Array]) -> Any:
    return jax.tree.map(lambda a: a[row["virtual"]], ctx.stage_params)


def _forward_common(ctx: _Context, state: dict[str, Any], row: dict[str, jax.Array]):
    state = dict(state)
    first = (row["virtual"] == 0) & (ctx.stage == 0)
    x = jnp.where(first, ctx.inputs[row["micro"]], state["x_box"][jnp.maximum(row["x_in"], 0)])
    p = _chunk(ctx, row)
    y, vjp = jax.vjp(ctx.stage_fn, p, x)
    leaves, treedef = jax.tree.flatten(vjp)
    keep = _param_mask(leaves, p)
    assert keep == ctx.keep, "stage_fn's residuals differ between traces"
    kept = [leaf for leaf, k in zip(leaves, keep, strict=True) if k < 0]
    state["stash"] = [_store(buf, row["stash"], leaf) for buf, leaf in zip(state["stash"], kept)]
    return state, y.astype(state["recv_x"].dtype)


def _forward(ctx: _Context, state: dict[str, Any], row: dict[str, jax.Array]) -> Branch:
    state, y = _forward_common(ctx, state, row)
    return state, _like(y, state["recv_x"]), jnp.zeros_like(state["recv_x"])


def _forward_last(ctx: _Context, state: dict[str, Any], row: dict[str, jax.Array]) -> Branch:
    state, y = _forward_common(ctx, state, row)
    target = jax.tree.map(lambda t: t[row["micro"]], ctx.targets)
    loss, (d_loss_params, dy) = jax.value_and_grad(ctx.loss_fn, argnums=(0, 1))(
        ctx.loss_params, y, target
    )
    state["loss"] = state["loss"] + _like(loss.astype(jnp.float32), state["loss"])
    state["loss_grads"] = jax.tree.map(
        lambda acc, g: acc + _like(g, acc), state["loss_grads"], d_loss_params
    )
    state["dy_box"] = _store(state["dy_box"], row["dy_in"], dy)
    zeros = jnp.zeros_like(state["recv_x"])
    return state, zeros, zeros


def _rebuilt_vjp(ctx: _Context, state: dict[str, Any], row: dict[str, jax.Array]) -> Any:
    params = jax.tree.leaves(_chunk(ctx, row))
    stored = iter(buf[jnp.maximum(row["stash"], 0)] for buf in state["stash"])
    leaves = [next(stored) if k < 0 else params[k] for k in ctx.keep]
    return jax.tree.unflatten(ctx.vjp_def, leaves)


def _backward(ctx: _Context, state: dict[str, Any], row: dict[str, jax.Array]) -> Branch:
    state = dict(state)
    dy = state["dy_box"][jnp.maximum(row["dy_in"], 0)]
    dp, dx = _rebuilt_vjp(ctx, state, row)(dy)
    if not ctx.schedule.split:
        state["grads"] = _accumulate(state["grads"], dp, row["virtual"])
    first = (row["virtual"] == 0) & (ctx.stage == 0)
    d_inputs = state["d_inputs"].at[row["micro"]].set(_like(dx, state["d_inputs"]))
    state["d_inputs"] = jnp.where(first, d_inputs, state["d_inputs"])
    send = jnp.where(first, jnp.zeros_like(dx), dx)
    return state, jnp.zeros_like(state["recv_x"]), _like(send, state["recv_dy"])


def _weights(ctx: _Context, state: dict[str, Any], row: dict[str, jax.Array]) -> Branch:
    state = dict(state)
    dy = state["dy_box"][jnp.maximum(row["dy_in"], 0)]
    dp, _ = _rebuilt_vjp(ctx, state, row)(dy)
    state["grads"] = _accumulate(state["grads"], dp, row["virtual"])
    zeros = jnp.zeros_like(state["recv_x"])
    return state, zeros, zeros


# ----------------------------------------------------------------------------- helpers


def _accumulate(grads: Any, dp: Any, v: jax.Array) -> Any:
    return jax.tree.map(lambda acc, g: acc.at[v].add(_like(g, acc)), grads, dp)


def _store(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """buffer with ``value`` at ``slot``; unchanged where slot < 0."""
    index = jnp.maximum(slot, 0)
    value = jnp.where(slot >= 0, _like(value, buffer), buffer[index])
    return jax.lax.dynamic_update_index_in_dim(buffer, value, index, 0)


def _axes_of(x: jax.Array) -> set[str]:
    """The mesh axes x is typed varying over (check_vma's type)."""
    return set(jax.typeof(x).mat.varying)


def _vma(tree: Any) -> set[str]:
    return set().union(*(_axes_of(leaf) for leaf in jax.tree.leaves(tree)))


def _vary_tree(tree: Any, axes: set[str]) -> Any:
    return jax.tree.map(lambda x: _vary(x, axes), tree)


def _vary(x: jax.Array, axes: set[str]) -> jax.Array:
    missing = tuple(sorted(axes - _axes_of(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """x cast to ref's dtype and typed varying over (at least) ref's axes."""
    return _vary(x.astype(ref.dtype), _axes_of(ref))


def _buffer(slots: int, like: jax.Array, axis: str) -> jax.Array:
    zeros = jnp.zeros((slots, *like.shape), like.dtype)
    return _vary(zeros, _axes_of(like) | {axis})


def _param_mask(leaves: list[Any], params: Any) -> tuple[int, ...]:
    """Per vjp leaf: the index of the chunk param it is, or −1 if it must be stashed."""
    param_ids = {id(p): i for i, p in enumerate(jax.tree.leaves(params))}
    return tuple(param_ids.get(id(leaf), -1) for leaf in leaves)


def _residual_layout(proto: Any, params: Any) -> tuple[tuple[Any, list[Any]], tuple[int, ...]]:
    leaves, treedef = jax.tree.flatten(proto)
    return (treedef, leaves), _param_mask(leaves, params)


__all__ = ["Tables", "pipeline_grads", "tables"]
