"""The pipeline engine: runs any ``schedules.Schedule`` inside ``shard_map`` over a stage axis.

Model-agnostic: a chunk is any ``stage_fn(chunk_params, x) -> y`` with y typed like x; an
``Ends`` holds what comes before chunk 0 (``embed_fn(embed_params, input) -> x``) and after the
last chunk (``loss_fn(loss_params, y, target) -> scalar``). Per device s of the ``stage`` axis
(S devices, V chunks each: chunk v·S + s):

  stage_params[V, ...]   this device's chunks      inputs[M, ...]   per microbatch (stage 0)
  embed / loss params    replicated over stage     targets[M, ...]  per microbatch (stage S−1)

``pipeline_grads`` scans the schedule's ticks. Each tick a device runs its table entry:

  F  y, vjp = jax.vjp(stage_fn, p[v], x), x embedded (chunk 0) or from the inbox; the vjp's
     residuals (all but the params, which stay where they are) go to a stash slot; y is sent
     to the next stage (``ppermute`` +1); on the last chunk the loss and dy = ∂loss/∂y are
     taken at once and dy goes to this device's own cotangent inbox.
  B  the vjp rebuilt from the stash, applied to dy from the inbox: dx is sent to the previous
     stage (−1); unsplit schedules take the weight gradient here too (chunk 0: and the
     embedding's, by its vjp re-run on the microbatch's input).
  W  (split schedules) the same vjp, for the weights only: XLA drops the unused half of each
     branch, so B computes only the input gradient and W only the weight gradient.

Collectives inside a chunk (or the embedding, or the loss) run inside the branch of the stage
that runs it, while the other stages run other branches. A collective whose device groups lie
within one stage is sound there (``psum``, ``all_gather``, ``psum_scatter``, ``all_to_all``
over ``model`` or ``seq``: tensor parallelism, Ulysses). A ``ppermute`` is not: XLA's
collective-permute is one instruction over every device its pairs name, across all stages, so
running it in a branch that some stages skip is not a valid program (measured on jax 0.10.2
CPU: wrong values, no error). The engine refuses such a function in one sentence
(``_check_no_permutes``); ring attention inside a pipeline stage is therefore refused, and
Ulysses is the sequence-parallel core that composes.

Buffers hold only what the schedule keeps in flight: the stash, the activation inbox and the
cotangent inbox each have as many slots as the busiest stage's most simultaneously live
entries (``tables``: slots assigned statically by interval colouring), so 1F1B's stash has S
slots whatever M is, while GPipe's has M. The SPMD program is the same on every device, so
every device allocates the busiest stage's slots. Idle ticks compute nothing (``lax.switch``
to an identity branch); buffers start at zeros and no unwritten slot is ever read (the
``poison`` test). The scan is split into segments by send pattern (``Tables.segments``: the
steady state, from the first cotangent send to the last activation send, is one segment that
sends both ways), and each tick of a segment runs one ``ppermute`` of one microbatch activation
in each direction it uses; a segment compiles only the branches it runs. Collectives inside a
branch carry the segment's and the branch's named scopes, so a ledger can count them per stage
(``branch_runs``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardkit.parallel.data import varying_axes
from shardkit.parallel.schedules import Schedule

StageFn = Callable[[Any, jax.Array], jax.Array]
EmbedFn = Callable[[Any, Any], jax.Array]
LossFn = Callable[[Any, jax.Array, Any], jax.Array]

IDLE = 0
KIND_INDEX = {"F": 0, "B": 1, "W": 2}
# Named scopes of the segment scans and the branches: collectives inside a branch carry both in
# their HLO op_name, so a ledger can count each by how often each stage runs it (``branch_runs``).
SEGMENT_SCOPE = "pp_segment{}"
BRANCH_SCOPE = "pp_branch{}"


def branch_index(kind: str, first: bool, last: bool) -> int:
    """The ``lax.switch`` branch of an action: idle is 0, then (kind, first chunk, last chunk)."""
    return 1 + 4 * KIND_INDEX[kind] + 2 * first + last


# ----------------------------------------------------------------------------- static tables


@dataclasses.dataclass(frozen=True)
class Tables:
    """The schedule as int32 arrays [ticks, S] the engine scans, and its buffer sizes.

    branch: ``branch_index`` of the action (0: idle); micro, virtual: the action's
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
        """Runs (start, stop, sends_x, sends_dy) of ticks, each scanned with one send pattern.

        Between the first cotangent send and the last activation send (1F1B's steady state)
        one segment sends both ways every tick; elsewhere each run of ticks with the same
        pattern is its own segment. So a schedule has at most a few segments whatever M is
        (with S = 2, 1F1B's steady state alternates F and B every tick: one segment per tick
        would make the program, and its compile time, grow with M).
        """
        x, dy = self.sends_x.tolist(), self.sends_dy.tolist()
        ticks = len(x)
        start = dy.index(True) if True in dy else ticks
        stop = ticks - x[::-1].index(True) if True in x else 0
        if start >= stop:
            return _runs(x, dy, 0, ticks)
        return [*_runs(x, dy, 0, start), (start, stop, True, True), *_runs(x, dy, stop, ticks)]

    def sent(self) -> tuple[int, int]:
        """(ticks that send activations, ticks that send cotangents) as the engine runs them:
        one ``ppermute`` of one microbatch activation each."""
        segs = self.segments()
        return sum(b - a for a, b, sx, _ in segs if sx), sum(b - a for a, b, _, sd in segs if sd)


Segment = tuple[int, int, bool, bool]


def _runs(x: list[bool], dy: list[bool], start: int, stop: int) -> list[Segment]:
    """Maximal runs of ticks in [start, stop) with the same (x, dy) send pattern."""
    out: list[Segment] = []
    for tick in range(start, stop):
        key = (x[tick], dy[tick])
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
        branch[tick, s] = branch_index(kind, c == 0, c == C - 1)
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
    return Tables(
        branch, micro, virtual, t["stash"], t["x_in"], t["dy_in"], t["x_arrive"], t["dy_arrive"],
        sends_x, sends_dy, sizes["stash"], sizes["x"], sizes["dy"],
    )  # fmt: skip


def branch_runs(schedule: Schedule) -> dict[tuple[int, int], np.ndarray]:
    """(segment k, branch b) -> runs per stage [S]: how many ticks of segment k each stage
    spends in branch b (``pipeline_grads``'s segments and ``branch_index``), and the segment
    lengths under key (k, −1)."""
    tab = tables(schedule)
    out: dict[tuple[int, int], np.ndarray] = {}
    for k, (start, stop, _, _) in enumerate(tab.segments()):
        rows = tab.branch[start:stop]
        out[(k, -1)] = np.full(schedule.stages, stop - start)
        for b in np.unique(rows).tolist():
            out[(k, b)] = (rows == b).sum(axis=0)
    return out


def _scoped(branch: Callable[..., Branch], index: int) -> Callable[..., Branch]:
    def run(*args: Any) -> Branch:
        with jax.named_scope(BRANCH_SCOPE.format(index)):
            return branch(*args)

    return run


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


@dataclasses.dataclass(frozen=True)
class Ends:
    """The model outside the chunks: ``embed_fn`` before chunk 0, ``loss_fn`` after the last.

    embed_fn: ``(embed_params, input_m) -> x`` (identity-like for a bare pipeline);
    loss_fn: ``(loss_params, y, target_m) -> scalar``. Both params replicated over the stage
    axis; their gradients come back summed over it (only the first / last stage adds to them).
    """

    embed_fn: EmbedFn
    embed_params: Any
    loss_fn: LossFn
    loss_params: Any


def pipeline_grads(
    schedule: Schedule,
    stage_fn: StageFn,
    stage_params: Any,
    ends: Ends,
    inputs: Any,
    targets: Any,
    *,
    axis: str = "stage",
    poison: bool = False,
) -> tuple[jax.Array, Any, Any, Any]:
    """Runs ``schedule`` forward and backward; call inside ``shard_map`` over ``axis``.

    Args:
      schedule: from ``schedules.build``; its S must equal the size of ``axis``.
      stage_fn: ``(chunk_params, x) -> y``, y shaped and typed like x.
      stage_params: this device's V chunks, every leaf stacked [V, ...].
      ends: the embedding before chunk 0 and the loss after the last chunk.
      inputs: pytree of [M, ...]: ``embed_fn``'s input per microbatch (read on stage 0).
      targets: pytree of [M, ...]: ``loss_fn``'s target per microbatch (read on stage S−1).
      axis: the pipeline's mesh axis.
      poison: start the stash, the inboxes and the receive buffers at NaN instead of zeros
        (a test: finite, equal gradients prove that no unwritten slot is ever read).

    Returns:
      (loss, d_stage_params, d_embed_params, d_loss_params): Σ_m loss and the gradients of
      that sum: for this device's chunks [V, ...] (varying over ``axis``), for the embedding and
      the loss params (invariant over ``axis``). Every gradient is still a partial sum over the
      inputs' other axes (``data``): sync them as for any data-parallel gradient.
    """
    _check_shapes(schedule, stage_params, inputs, targets, axis)
    tab = tables(schedule)
    first_input = jax.tree.map(lambda a: a[0], inputs)
    # Everything a branch computes varies over the inputs' axes and the stage; params are cast
    # to vary there too, so their gradients are partial sums (no collective inside a branch).
    act_axes = _vma(inputs) | {axis}
    stage_params = _vary_tree(stage_params, act_axes)
    ends = dataclasses.replace(
        ends,
        embed_params=_vary_tree(ends.embed_params, act_axes),
        loss_params=_vary_tree(ends.loss_params, act_axes),
    )
    x0 = _vary(ends.embed_fn(ends.embed_params, first_input), act_axes)
    chunk0 = jax.tree.map(lambda a: a[0], stage_params)
    y0, proto = jax.vjp(stage_fn, chunk0, x0)
    if _axes_of(y0) != _axes_of(x0) or y0.shape != x0.shape or y0.dtype != x0.dtype:
        raise ValueError(
            f"stage_fn must map x {x0.dtype}{list(x0.shape)} varying over "
            f"{sorted(_axes_of(x0))} to the same type, got {y0.dtype}{list(y0.shape)} varying "
            f"over {sorted(_axes_of(y0))}."
        )
    _check_no_permutes(
        lambda p, x, ep, lp, i, t: (
            jax.vjp(stage_fn, p, x)[1](y0),
            jax.vjp(ends.embed_fn, ep, i),
            jax.value_and_grad(ends.loss_fn, argnums=(0, 1))(lp, y0, t),
        ),
        chunk0, x0, ends.embed_params, ends.loss_params, first_input,
        jax.tree.map(lambda a: a[0], targets),
    )  # fmt: skip
    leaves, vjp_def = jax.tree.flatten(proto)
    keep = _param_mask(leaves, chunk0)
    fill = np.nan if poison else 0.0
    act = _vary(jnp.full_like(x0, fill), _axes_of(x0))
    state = dict(
        # Residuals vary over the stage at least (a branch reads its chunk by a stage-varying
        # index, so even one traced invariant, a mask, comes out varying there).
        stash=[
            _buffer(tab.stash_slots, _vary(a, act_axes), fill)
            for a, k in zip(leaves, keep, strict=True)
            if k < 0
        ],
        x_box=_buffer(tab.x_slots, act, fill),
        dy_box=_buffer(tab.dy_slots, act, fill),
        grads=jax.tree.map(jnp.zeros_like, stage_params),
        embed_grads=jax.tree.map(jnp.zeros_like, ends.embed_params),
        loss_grads=jax.tree.map(jnp.zeros_like, ends.loss_params),
        loss=_vary(jnp.zeros((), jnp.float32), act_axes),
        recv_x=act,
        recv_dy=act,
    )
    stage = jax.lax.axis_index(axis)
    ctx = _Context(schedule, stage_fn, stage_params, ends, inputs, targets, axis, stage,
                   vjp_def, keep)  # fmt: skip
    for k, (start, stop, send_x, send_dy) in enumerate(tab.segments()):
        rows = tab.rows(start, stop)
        # Only the branches this segment runs are compiled into its switch (row → position).
        used = sorted({IDLE, *np.unique(rows["branch"]).tolist()})
        rows["branch"] = np.searchsorted(used, rows["branch"]).astype(np.int32)
        body = _tick_body(ctx, send_x, send_dy, used)
        with jax.named_scope(SEGMENT_SCOPE.format(k)):
            state, _ = jax.lax.scan(body, state, {n: jnp.asarray(v) for n, v in rows.items()})
    loss, embed_grads, loss_grads = jax.lax.psum(
        (state["loss"], state["embed_grads"], state["loss_grads"]), axis
    )
    return loss, state["grads"], embed_grads, loss_grads


def _check_shapes(
    schedule: Schedule, stage_params: Any, inputs: Any, targets: Any | None, axis: str
) -> None:
    """ValueError (one sentence) unless the mesh, the chunks and the microbatches fit the
    schedule: an out-of-range microbatch or chunk index would be clamped, not caught."""
    n = jax.lax.axis_size(axis)
    if n != schedule.stages:
        raise ValueError(
            f"The schedule has {schedule.stages} stages but the {axis!r} axis has {n} devices."
        )
    for name, tree, want in (
        ("stage_params", stage_params, schedule.virtual),
        ("inputs", inputs, schedule.micro),
        ("targets", () if targets is None else targets, schedule.micro),
    ):
        for leaf in jax.tree.leaves(tree):
            if leaf.ndim == 0 or leaf.shape[0] != want:
                what = "chunks per device (V)" if name == "stage_params" else "microbatches (M)"
                raise ValueError(
                    f"Every {name} leaf needs a leading dim of {want} {what}, got shape "
                    f"{list(leaf.shape)}."
                )


@dataclasses.dataclass(frozen=True)
class _Context:
    schedule: Schedule
    stage_fn: StageFn
    stage_params: Any
    ends: Ends
    inputs: Any
    targets: Any
    axis: str
    stage: jax.Array
    vjp_def: Any
    keep: tuple[int, ...]  # per vjp leaf: chunk param index, or −1 (stashed)


def _tick_body(ctx: _Context, send_x: bool, send_dy: bool, used: list[int]) -> Callable[..., Any]:
    """One tick: store what arrived, run the branch (among ``used``, by ``branch_index``),
    send."""
    forward_pairs = _forward_pairs(ctx.schedule)
    backward_pairs = [(d, s) for s, d in forward_pairs]
    branches = [_idle] + [
        functools.partial(fn, first=first, last=last)
        for fn in (_forward, _backward, _weights)
        for first in (False, True)
        for last in (False, True)
    ]
    branches = [_scoped(branches[i], i) for i in used]

    def body(state: dict[str, Any], rows: dict[str, jax.Array]) -> tuple[dict[str, Any], None]:
        row = {k: v[ctx.stage] for k, v in rows.items()}
        state = dict(state)
        state["x_box"] = _store(state["x_box"], row["x_arrive"], state["recv_x"])
        state["dy_box"] = _store(state["dy_box"], row["dy_arrive"], state["recv_dy"])
        state, out_x, out_dy = jax.lax.switch(
            row["branch"], [functools.partial(b, ctx) for b in branches], state, row
        )
        zeros = jnp.zeros_like(state["recv_x"])
        state["recv_x"] = jax.lax.ppermute(out_x, ctx.axis, forward_pairs) if send_x else zeros
        state["recv_dy"] = jax.lax.ppermute(out_dy, ctx.axis, backward_pairs) if send_dy else zeros
        return state, None

    return body


Branch = tuple[dict[str, Any], jax.Array, jax.Array]
Row = dict[str, jax.Array]


def _idle(ctx: _Context, state: dict[str, Any], row: Row) -> Branch:
    zeros = jnp.zeros_like(state["recv_x"])
    return state, zeros, zeros


def _chunk(ctx: _Context, row: Row) -> Any:
    return jax.tree.map(lambda a: a[row["virtual"]], ctx.stage_params)


def _micro(tree: Any, row: Row) -> Any:
    return jax.tree.map(lambda a: a[row["micro"]], tree)


def _embed(ctx: _Context, row: Row) -> tuple[jax.Array, Callable[..., Any]]:
    embed = ctx.ends.embed_fn
    return jax.vjp(lambda ep: embed(ep, _micro(ctx.inputs, row)), ctx.ends.embed_params)


def _forward(ctx: _Context, state: dict[str, Any], row: Row, *, first: bool, last: bool) -> Branch:
    """F: the chunk's forward; its vjp residuals stashed; y sent on, or the loss taken."""
    state = dict(state)
    zeros = jnp.zeros_like(state["recv_x"])
    x = _embed(ctx, row)[0] if first else state["x_box"][jnp.maximum(row["x_in"], 0)]
    p = _chunk(ctx, row)
    y, vjp = jax.vjp(ctx.stage_fn, p, _like(x, zeros))
    leaves = jax.tree.leaves(vjp)
    assert _param_mask(leaves, p) == ctx.keep, "stage_fn's residuals differ between traces"
    stashed = [leaf for leaf, k in zip(leaves, ctx.keep, strict=True) if k < 0]
    state["stash"] = [
        _store(b, row["stash"], leaf) for b, leaf in zip(state["stash"], stashed, strict=True)
    ]
    if not last:
        return state, _like(y, zeros), zeros
    loss_fn = ctx.ends.loss_fn
    loss, (d_loss_params, dy) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
        ctx.ends.loss_params, y, _micro(ctx.targets, row)
    )
    state["loss"] = state["loss"] + _like(loss.astype(jnp.float32), state["loss"])
    state["loss_grads"] = _add(state["loss_grads"], d_loss_params)
    state["dy_box"] = _store(state["dy_box"], row["dy_in"], dy)
    return state, zeros, zeros


def _rebuilt_vjp(ctx: _Context, state: dict[str, Any], row: Row) -> Any:
    params = jax.tree.leaves(_chunk(ctx, row))
    stored = iter(buf[jnp.maximum(row["stash"], 0)] for buf in state["stash"])
    leaves = [next(stored) if k < 0 else params[k] for k in ctx.keep]
    return jax.tree.unflatten(ctx.vjp_def, leaves)


def _backward(ctx: _Context, state: dict[str, Any], row: Row, *, first: bool, last: bool) -> Branch:
    """B: the input gradient sent back (chunk 0: into the embedding); unsplit schedules also
    take the weight gradient here."""
    weights = not ctx.schedule.split
    return _apply_vjp(ctx, state, row, first=first, weights=weights, send=not first)


def _weights(ctx: _Context, state: dict[str, Any], row: Row, *, first: bool, last: bool) -> Branch:
    """W (split schedules): the weight gradient of a chunk whose B already ran."""
    return _apply_vjp(ctx, state, row, first=first, weights=True, send=False)


def _apply_vjp(
    ctx: _Context, state: dict[str, Any], row: Row, *, first: bool, weights: bool, send: bool
) -> Branch:
    state = dict(state)
    zeros = jnp.zeros_like(state["recv_x"])
    dy = state["dy_box"][jnp.maximum(row["dy_in"], 0)]
    dp, dx = _rebuilt_vjp(ctx, state, row)(dy)
    if weights:
        state["grads"] = jax.tree.map(
            lambda acc, g: acc.at[row["virtual"]].add(_like(g, acc)), state["grads"], dp
        )
        if first:  # the embedding's weights: its vjp re-run on this microbatch's input
            (d_embed,) = _embed(ctx, row)[1](_like(dx, zeros))
            state["embed_grads"] = _add(state["embed_grads"], d_embed)
    return state, zeros, _like(dx, zeros) if send else zeros


# ----------------------------------------------------------------------------- forward only


@dataclasses.dataclass(frozen=True)
class ForwardTables:
    """A schedule's forwards alone, as the int32 arrays [ticks, S] ``pipeline_forward`` scans.

    The schedule's F actions in their order, ticks without one dropped (the order, hence
    every dependency, is kept). branch: 0 idle, else 1 + 2·first chunk + last chunk; micro,
    virtual, x_in, x_arrive as in :class:`Tables`; sends [ticks]: some stage sends.
    """

    branch: np.ndarray
    micro: np.ndarray
    virtual: np.ndarray
    x_in: np.ndarray
    x_arrive: np.ndarray
    sends: np.ndarray
    x_slots: int

    def rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
        names = ("branch", "micro", "virtual", "x_in", "x_arrive")
        return {name: getattr(self, name)[start:stop] for name in names}

    def segments(self) -> list[tuple[int, int, bool]]:
        """Runs (start, stop, sends) of ticks with the same send pattern."""
        sends = self.sends.tolist()
        return [(a, b, x) for a, b, x, _ in _runs(sends, [False] * len(sends), 0, len(sends))]


def forward_tables(schedule: Schedule) -> ForwardTables:
    """The forward-only tables of ``schedule`` (for inference: no stash, no cotangents)."""
    S, C = schedule.stages, schedule.chunks
    rows = [[a if a is not None and a.kind == "F" else None for a in row] for row in schedule.grid]
    rows = [row for row in rows if any(a is not None for a in row)]
    when = {
        (a.virtual * S + s, a.micro): t
        for t, row in enumerate(rows)
        for s, a in enumerate(row)
        if a is not None
    }
    x_box = {(c, m): (c % S, when[(c - 1, m)] + 1, t) for (c, m), t in when.items() if c > 0}
    slots = _colour(x_box)
    shape = (len(rows), S)
    branch, micro, virtual = (np.zeros(shape, np.int32) for _ in range(3))
    x_in, x_arrive = np.full(shape, -1, np.int32), np.full(shape, -1, np.int32)
    sends = np.zeros(len(rows), bool)
    for (c, m), t in when.items():
        s = c % S
        branch[t, s] = 1 + 2 * (c == 0) + (c == C - 1)
        micro[t, s], virtual[t, s] = m, c // S
        sends[t] |= c < C - 1
        if c > 0:
            x_in[t, s] = slots[(c, m)]
            x_arrive[x_box[(c, m)][1], s] = slots[(c, m)]
    size = 1 + max(slots.values(), default=0)
    return ForwardTables(branch, micro, virtual, x_in, x_arrive, sends, size)


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
    act_axes = _vma(inputs) | {axis}
    stage_params = _vary_tree(stage_params, act_axes)
    embed_params = _vary_tree(embed_params, act_axes)
    head_params = _vary_tree(head_params, act_axes)
    x0 = _vary(embed_fn(embed_params, jax.tree.map(lambda a: a[0], inputs)), act_axes)
    chunk0 = jax.tree.map(lambda a: a[0], stage_params)
    _check_no_permutes(
        lambda p, x, ep, hp, i: (stage_fn(p, x), embed_fn(ep, i), head_fn(hp, x)),
        chunk0, x0, embed_params, head_params, jax.tree.map(lambda a: a[0], inputs),
    )  # fmt: skip
    out0 = head_fn(head_params, stage_fn(chunk0, x0))
    act = jnp.zeros_like(x0)
    state = dict(
        x_box=_buffer(tab.x_slots, act, 0.0),
        out=_buffer(schedule.micro, _vary(out0, act_axes), 0.0),
        recv=act,
    )
    stage = jax.lax.axis_index(axis)
    pairs = _forward_pairs(schedule)

    def forward(first: bool, last: bool, state: dict[str, Any], row: Row) -> tuple[Any, Any]:
        state = dict(state)
        chunk = jax.tree.map(lambda a: a[row["virtual"]], stage_params)
        if first:
            x = _like(embed_fn(embed_params, _micro(inputs, row)), act)
        else:
            x = state["x_box"][jnp.maximum(row["x_in"], 0)]
        y = stage_fn(chunk, x)
        if not last:
            return state, _like(y, act)
        out = _like(head_fn(head_params, y), state["out"])
        state["out"] = jax.lax.dynamic_update_index_in_dim(state["out"], out, row["micro"], 0)
        return state, act

    branches = [lambda state, row: (state, act)] + [
        functools.partial(forward, first, last) for first in (False, True) for last in (False, True)
    ]

    def tick(send: bool) -> Callable[..., Any]:
        def body(state: dict[str, Any], rows: dict[str, jax.Array]) -> tuple[Any, None]:
            row = {k: v[stage] for k, v in rows.items()}
            state = dict(state, x_box=_store(state["x_box"], row["x_arrive"], state["recv"]))
            state, out = jax.lax.switch(row["branch"], branches, state, row)
            state["recv"] = jax.lax.ppermute(out, axis, pairs) if send else act
            return state, None

        return body

    for start, stop, send in tab.segments():
        rows = {k: jnp.asarray(v) for k, v in tab.rows(start, stop).items()}
        state, _ = jax.lax.scan(tick(send), state, rows)
    return jax.lax.psum(state["out"], axis)


# ----------------------------------------------------------------------------- helpers


def _forward_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """ppermute pairs stage s -> s+1 (wrapping round when chunks are interleaved, V > 1)."""
    S = schedule.stages
    return [(s, (s + 1) % S) for s in range(S if schedule.virtual > 1 else S - 1)]


def _check_no_permutes(fn: Callable[..., Any], *args: Any) -> None:
    """ValueError (one sentence) if ``fn`` (a chunk, the embedding or the loss, with their
    backward) runs a ``ppermute``: it would run inside a schedule branch (module docstring)."""
    axes = sorted(_permute_axes(jax.make_jaxpr(fn)(*args).jaxpr))
    if axes:
        raise ValueError(
            f"The pipeline's stage, embedding or loss function runs a ppermute over "
            f"{', '.join(map(repr, axes))}, which cannot run inside a schedule branch that only "
            "some stages take (XLA's collective-permute spans every stage); use collectives "
            "whose groups lie within a stage (psum, all_gather, psum_scatter, all_to_all)."
        )


def _permute_axes(jaxpr: Any) -> set[str]:
    """The axes of every ``ppermute`` in ``jaxpr`` and the jaxprs nested in its equations."""
    out: set[str] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            names = eqn.params["axis_name"]
            out |= set(names if isinstance(names, tuple) else (names,))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out |= _permute_axes(inner)
    return out


def _add(acc: Any, grads: Any) -> Any:
    return jax.tree.map(lambda a, g: a + _like(g, a), acc, grads)


def _store(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """buffer with ``value`` at ``slot``; unchanged where slot < 0."""
    index = jnp.maximum(slot, 0)
    value = jnp.where(slot >= 0, _like(value, buffer), buffer[index])
    return jax.lax.dynamic_update_index_in_dim(buffer, value, index, 0)


def _axes_of(x: jax.Array) -> set[str]:
    return set(varying_axes(x))


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


def _buffer(slots: int, like: jax.Array, fill: float) -> jax.Array:
    """[slots, *like.shape] of ``fill`` (integer residuals: 0), typed like ``like``."""
    value = fill if jnp.issubdtype(like.dtype, jnp.floating) else 0
    return _vary(jnp.full((slots, *like.shape), value, like.dtype), _axes_of(like))


def _param_mask(leaves: list[Any], params: Any) -> tuple[int, ...]:
    """Per vjp leaf: the index of the chunk param it is, or −1 if it must be stashed."""
    param_ids = {id(p): i for i, p in enumerate(jax.tree.leaves(params))}
    return tuple(param_ids.get(id(leaf), -1) for leaf in leaves)


__all__ = [
    "Ends",
    "ForwardTables",
    "Tables",
    "branch_runs",
    "forward_tables",
    "pipeline_forward",
    "pipeline_grads",
    "tables",
]
