"""The pipeline engine: runs any ``schedules.Schedule`` inside ``shard_map`` over a stage axis.

The model-agnostic contract, the tick actions and the buffer rules are the package docstring's
(``shardkit.parallel.pipeline``). ``pipeline_grads`` scans ``tables.tables(schedule)``
segment by segment; each tick runs one ``lax.switch`` branch per stage (F, B or W, first /
last chunk variants, idle), which reads the buffers and returns its writes (``writes``:
applied after the switch, so that no buffer is copied whole each tick), and one ``ppermute``
per direction the segment sends in.
``pipeline_forward`` does the same for the forwards alone.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardkit.parallel.pipeline import schedules
from shardkit.parallel.pipeline.chunk import bound
from shardkit.parallel.pipeline.schedules import Schedule
from shardkit.parallel.pipeline.sends import Sends, segment_sends, send
from shardkit.parallel.pipeline.split import SplitBackward
from shardkit.parallel.pipeline.tables import (
    BRANCH_SCOPE,
    IDLE,
    SEGMENT_SCOPE,
    Tables,
    branch_parts,
    tables,
)
from shardkit.parallel.pipeline.writes import (
    Row,
    Writes,
    apply,
    buffer,
    like,
    no_writes,
    store,
    typed,
    zeros_over,
)
from shardkit.parallel.vma import tree_varying_axes, vary, vary_tree, varying_axes

StageFn = Callable[..., Any]  # (chunk_params, x[, side_m]) -> y, or (y, aux loss[, metrics])
EmbedFn = Callable[[Any, Any], jax.Array]
LossFn = Callable[[Any, jax.Array, Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class Ends:
    """The model outside the chunks: ``embed_fn`` before chunk 0, ``loss_fn`` after the last.

    embed_fn: ``(embed_params, input_m) -> x`` (identity-like for a bare pipeline);
    loss_fn: ``(loss_params, y, target_m) -> scalar``. Both params replicated over the stage
    axis; their gradients come back summed over it (only the first / last stage adds to them).
    ``tied``: keys of both params dicts that are one array (tied embeddings): its two
    gradients are added before the sum over stage, which then sends it once, and come back
    in the embedding's gradients only.
    """

    embed_fn: EmbedFn
    embed_params: Any
    loss_fn: LossFn
    loss_params: Any
    tied: tuple[str, ...] = ()


def pipeline_grads(
    schedule: Schedule,
    stage_fn: StageFn,
    stage_params: Any,
    ends: Ends,
    inputs: Any,
    targets: Any,
    *,
    side: Any = None,
    aux: bool = False,
    axis: str = "stage",
    poison: bool = False,
    uniform: bool | None = None,
) -> tuple[Any, Any, Any, Any]:
    """Runs ``schedule`` forward and backward; call inside ``shard_map`` over ``axis``.

    Args:
      schedule: from ``schedules.build``; its S must equal the size of ``axis``.
      stage_fn: ``(chunk_params, x[, side_m]) -> y`` typed like x; with ``aux``, ``(y, aux[,
        metrics])``: a scalar loss term (MoE balance losses) summed into the loss with its
        gradient, and a pytree (routing counts) summed over every forward, without one.
      stage_params: this device's V chunks, every leaf stacked [V, ...].
      ends: the embedding before chunk 0 and the loss after the last chunk.
      inputs: pytree of [M, ...]: ``embed_fn``'s input per microbatch (read on stage 0).
      targets: pytree of [M, ...]: ``loss_fn``'s target per microbatch (read on stage S−1).
      side: pytree of [M, ...] or None: per-microbatch inputs of every chunk (segment ids).
      axis: the pipeline's mesh axis.
      poison: start the stash, the inboxes and the receive buffers at NaN, not zeros (a test:
        finite, equal gradients prove that no unwritten slot is ever read, or, in the uniform
        form, that what a stage computes masked never reaches a result).
      uniform: True runs the uniform form (``schedules.uniform``); None, exactly when the
        chunk, the embedding or the loss runs a ``ppermute`` (refused with False); otherwise
        the schedule's own form (``Schedule.form``: branch, phased or uniform).

    Returns:
      (loss, d_stage_params, d_embed_params, d_loss_params): Σ_m loss (with metrics: (Σ_m
      loss, Σ metrics)) and its gradients: for this device's chunks [V, ...] (varying over
      ``axis``), for the embedding and the loss params (invariant over ``axis``; a tied key's
      in the embedding's only), each a partial sum over the inputs' other axes (``data``).
    """
    _check_shapes(schedule, stage_params, (inputs, side), targets, axis)
    act_axes = tree_varying_axes(inputs) | {axis}
    stage_params, ends, x0, side = _typed_for_branches(stage_params, ends, inputs, side, act_axes)
    chunk0, first_fn = jax.tree.map(lambda a: a[0], stage_params), bound(stage_fn, side, 0, aux)
    y0, proto, metrics = _first_chunk(first_fn, chunk0, x0, axis)
    firsts = (jax.tree.map(lambda a: a[0], inputs), jax.tree.map(lambda a: a[0], targets))
    schedule = _form(schedule, _model_permutes(first_fn, ends, chunk0, x0, y0, firsts), uniform)
    leaves, vjp_def = jax.tree.flatten(proto)
    keep, tab = _param_mask(leaves, chunk0), tables(schedule)
    fill = np.nan if poison else 0.0
    state = _initial_state(tab, stage_params, ends, x0, act_axes, (leaves, keep), fill, metrics)
    split = _split_backward(schedule, vjp_def, leaves, y0, tab, state, (act_axes, fill))
    chunk_fn, stage = bound(stage_fn, side, None, aux), jax.lax.axis_index(axis)
    ctx = _Context(schedule, chunk_fn, stage_params, ends, inputs, targets, axis, stage,
                   vjp_def, keep, split, tab.x_pairs, tab.dy_pairs)  # fmt: skip
    state = _run_segments(ctx, tab, state)
    totals = (state["loss"], state["metrics"], *_ends_grads(ends, state))
    loss, metrics, embed_grads, loss_grads = jax.lax.psum(totals, axis)  # one all-reduce
    return loss if metrics is None else (loss, metrics), state["grads"], embed_grads, loss_grads


def _first_chunk(first_fn: Callable[..., Any], chunk0: Any, x0: jax.Array, axis: str) -> Any:
    """(y0, the vjp, the metrics' zeros or None) of the first chunk on the first microbatch,
    checked (``_check_stage_fn``); the metrics' zeros typed varying over ``axis`` too."""
    y0, proto, aux0 = jax.vjp(first_fn, chunk0, x0, has_aux=True)
    _check_stage_fn(x0, y0, aux0)
    return y0, proto, None if aux0 is None else zeros_over(aux0[1], frozenset({axis}))


def _ends_grads(ends: Ends, state: dict[str, Any]) -> tuple[Any, Any]:
    """The embedding's and the loss's gradients, each tied key's two as one, in the
    embedding's (``Ends.tied``)."""
    tied, embed_grads, loss_grads = ends.tied, state["embed_grads"], state["loss_grads"]
    if not tied:
        return embed_grads, loss_grads
    summed = {k: jax.tree.map(jnp.add, embed_grads[k], loss_grads[k]) for k in tied}
    return {**embed_grads, **summed}, {k: g for k, g in loss_grads.items() if k not in tied}


def _split_backward(
    schedule: Schedule, vjp_def: Any, leaves: list[Any], y0: jax.Array, tab: Tables,
    state: dict[str, Any], buffers: tuple[frozenset[str], float],
) -> SplitBackward | None:  # fmt: skip
    """Split schedules: the chunk's backward cut into B and W (``split.SplitBackward``), and
    the W stash added to ``state``: a buffer per value B hands W (its cut, then dx)."""
    if not schedule.split:
        return None
    act_axes, fill = buffers
    dy0 = like(y0, state["dy_box"])
    split = SplitBackward(lambda res, dy: jax.tree.unflatten(vjp_def, res)(dy), leaves, dy0)
    dx0, cut0 = split.input_grad(leaves, dy0)
    state["w_stash"] = [buffer(tab.w_slots, vary(a, act_axes), fill) for a in [*cut0, dx0]]
    return split


def _model_permutes(
    stage_fn: Callable[..., Any], ends: Ends, chunk0: Any, x0: jax.Array, y0: jax.Array, firsts: Any
) -> set[str]:
    """The axes of every ``ppermute`` the chunk, the embedding or the loss (with their
    backward) runs, traced on the first microbatch (``firsts``: its input and target)."""
    return _permute_axes_of(
        lambda p, x, ep, lp, i, t: (
            jax.vjp(stage_fn, p, x, has_aux=True)[1](y0),
            jax.vjp(ends.embed_fn, ep, i),
            jax.value_and_grad(ends.loss_fn, argnums=(0, 1))(lp, y0, t),
        ),
        chunk0, x0, ends.embed_params, ends.loss_params, *firsts,
    )  # fmt: skip


def _form(schedule: Schedule, permutes: set[str], uniform: bool | None) -> Schedule:
    """The schedule in the form the engine runs (``pipeline_grads``'s ``uniform``)."""
    if permutes and uniform is False:
        raise ValueError(
            f"The pipeline's stage, embedding or loss function runs a ppermute over "
            f"{', '.join(map(repr, sorted(permutes)))}, which the branch form cannot run (XLA's "
            "collective-permute waits for every stage, and only some take the branch); run "
            "the uniform form (uniform=True or None)."
        )
    return schedules.uniform(schedule) if (uniform or permutes) else schedule


def _run_segments(ctx: _Context, tab: Tables, state: dict[str, Any]) -> dict[str, Any]:
    """Scans the ticks segment by segment, each compiling only the branches it runs."""
    for k, segment in enumerate(tab.segments()):
        start, stop, _, _ = segment
        rows = tab.rows(start, stop)
        sends = segment_sends(tab, segment)
        if tab.period == 1:
            # Only the branches this segment runs are compiled into its switch (row → position).
            used = sorted({IDLE, *np.unique(rows["branch"]).tolist()})
            rows["branch"] = np.searchsorted(used, rows["branch"]).astype(np.int32)
            body, xs = _tick_body(ctx, sends, used), {"rows": rows}
        else:
            body, xs = _super_tick_segment(ctx, tab, (start, stop), sends)
        xs["carry"] = sends.positions
        with jax.named_scope(SEGMENT_SCOPE.format(k)):
            state, _ = jax.lax.scan(body, state, jax.tree.map(jnp.asarray, xs))
    return state


def _typed_for_branches(
    stage_params: Any, ends: Ends, inputs: Any, side: Any, act_axes: frozenset[str]
) -> tuple[Any, Ends, jax.Array, Any]:
    """(stage_params, ends, x0 = the first microbatch embedded, side), all typed varying over
    ``act_axes`` (the inputs' axes and the stage): everything a branch computes varies there,
    so the params' gradients come out as partial sums (no collective inside a branch), and
    a chunk's residuals are typed alike whichever microbatch's side inputs it reads."""
    ends = dataclasses.replace(
        ends,
        embed_params=vary_tree(ends.embed_params, act_axes),
        loss_params=vary_tree(ends.loss_params, act_axes),
    )
    x0 = vary(ends.embed_fn(ends.embed_params, jax.tree.map(lambda a: a[0], inputs)), act_axes)
    side = None if side is None else vary_tree(side, act_axes)
    return vary_tree(stage_params, act_axes), ends, x0, side


def _check_stage_fn(x0: jax.Array, y0: jax.Array, aux0: Any) -> None:
    """ValueError (one sentence) unless ``stage_fn`` maps x to a y of x's shape and type (and
    a scalar aux loss, if it returns one)."""
    if aux0 is not None and jnp.shape(aux0[0]) != ():
        raise ValueError(f"stage_fn's aux loss must be a scalar, got shape {jnp.shape(aux0[0])}.")
    if varying_axes(y0) != varying_axes(x0) or y0.shape != x0.shape or y0.dtype != x0.dtype:
        raise ValueError(
            f"stage_fn must map x {x0.dtype}{list(x0.shape)} varying over "
            f"{sorted(varying_axes(x0))} to the same type, got {y0.dtype}{list(y0.shape)} varying "
            f"over {sorted(varying_axes(y0))}."
        )


def _initial_state(
    tab: Tables, stage_params: Any, ends: Ends, x0: jax.Array, act_axes: frozenset[str],
    residuals: tuple[list[Any], tuple[int, ...]], fill: float, metrics: Any,
) -> dict[str, Any]:  # fmt: skip
    """The scan carry: stash and inboxes filled with ``fill``, gradients and loss at zero,
    and ``metrics`` (the chunk's metrics' zeros, or None).

    The loss and the stash vary over ``act_axes`` (the inputs' axes and the stage), not over
    x0's: an activation may vary over more (Megatron-SP's tokens over ``model``) while the
    loss, summed over the tokens, does not.
    """
    leaves, keep = residuals
    act = vary(jnp.full_like(x0, fill), varying_axes(x0))
    # Residuals vary over the stage at least (a branch reads its chunk by a stage-varying
    # index, so even one traced invariant, a mask, comes out varying there).
    stashed = [a for a, k in zip(leaves, keep, strict=True) if k < 0]
    return dict(
        stash=[buffer(tab.stash_slots, vary(a, act_axes), fill) for a in stashed],
        x_box=buffer(tab.x_slots, act, fill),
        dy_box=buffer(tab.dy_slots, act, fill),
        grads=jax.tree.map(jnp.zeros_like, stage_params),
        embed_grads=jax.tree.map(jnp.zeros_like, ends.embed_params),
        loss_grads=jax.tree.map(jnp.zeros_like, ends.loss_params),
        loss=vary(jnp.zeros((), jnp.float32), act_axes),
        metrics=metrics,
        recv_x=[act] * len(tab.x_pairs),  # what each permute delivered, stored next tick
        recv_dy=[act] * len(tab.dy_pairs),
    )


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
    chunk_fn: Callable[..., Any]  # (params, x, m=micro) -> (y, aux loss or None): ``bound``
    stage_params: Any
    ends: Ends
    inputs: Any
    targets: Any
    axis: str
    stage: jax.Array
    vjp_def: Any
    keep: tuple[int, ...]  # per vjp leaf: chunk param index, or −1 (stashed)
    split: SplitBackward | None  # split schedules: the backward cut into B and W
    x_pairs: tuple[tuple[tuple[int, int], ...], ...]  # per activation permute, its pairs
    dy_pairs: tuple[tuple[tuple[int, int], ...], ...]


def _tick_body(ctx: _Context, sends: Sends, used: list[int]) -> Callable[..., Any]:
    """One tick: store what arrived, run the branch (among ``used``, by ``branch_index``),
    send."""
    branches = _branches(used)

    def body(state: dict[str, Any], xs: dict[str, Any]) -> tuple[dict[str, Any], None]:
        row = {k: v[ctx.stage] for k, v in xs["rows"].items()}
        state = _arrivals(state, row)
        writes, out_x, out_dy = jax.lax.switch(
            row["branch"], [functools.partial(b, ctx) for b in branches], state, row
        )
        state = apply(state, writes)
        return _send(ctx, state, (out_x, out_dy), sends, xs["carry"]), None

    return body


def _branches(used: list[int]) -> list[Callable[..., Branch]]:
    """The switch's branches for the ``branch_index`` values ``used`` (idle first), each
    writing the fields of every kind among them (one switch, one writes structure)."""
    kinds = frozenset(int(branch_parts(b)[0]) for b in used if b != IDLE)
    fns = (_forward, _backward, _weights)

    def branch(b: int) -> Callable[..., Branch]:
        if b == IDLE:
            return _scoped(functools.partial(_idle, kinds=kinds), b)
        kind, first, last = branch_parts(b)
        return _scoped(functools.partial(fns[kind], first=first, last=last, kinds=kinds), b)

    return [branch(b) for b in used]


def _arrivals(state: dict[str, Any], row: Row) -> dict[str, Any]:
    """state with what each permute delivered last tick stored in its inbox slot."""
    state = dict(state)
    for box, recv, arrive in (("x_box", "recv_x", "x_arrive"), ("dy_box", "recv_dy", "dy_arrive")):
        for k, value in enumerate(state[recv]):
            state[box] = store(state[box], row[arrive][k], value)
    return state


def _send(
    ctx: _Context, state: dict[str, Any], outs: tuple[jax.Array, jax.Array], sends: Sends,
    carry: dict[str, jax.Array],
) -> dict[str, Any]:  # fmt: skip
    """state with this tick's activation and cotangent sent (``sends.send``): what each of
    their permutes delivered, stored at the next tick's start (``_arrivals``)."""
    state = dict(state)
    for kind, out, pairs in (("x", outs[0], ctx.x_pairs), ("dy", outs[1], ctx.dy_pairs)):
        state[f"recv_{kind}"] = send(kind, out, sends, pairs, ctx.axis, carry.get(kind))
    return state


def _super_tick_segment(
    ctx: _Context, tab: Tables, span: tuple[int, int], sends: Sends
) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The scan body over super ticks [start, stop) and what it scans: the tables [ticks, P,
    S] and per phase each stage's switch position. Uniform form (``tab.masked``): every stage
    runs the phase's variant (``Tables.variants``) on its own table entry and masks what is
    not its own. Phased form: every stage runs its own branch, idle phases nothing."""
    start, stop = span
    period = tab.period
    ticks = stop - start  # not −1: a table may have no permute column (one stage)
    rows = {k: v.reshape(ticks, period, *v.shape[1:]) for k, v in tab.rows(start, stop).items()}
    picks = tab.variants[start:stop] if tab.masked else rows["branch"]  # [ticks, P(, S)]
    used = [sorted({IDLE, *np.unique(picks[:, p]).tolist()}) for p in range(period)]
    position = np.stack([np.searchsorted(u, picks[:, p]) for p, u in enumerate(used)], 1)
    phases = [_branches(u) for u in used]

    def body(state: dict[str, Any], xs: dict[str, Any]) -> tuple[dict[str, Any], None]:
        state = _arrivals(state, {k: v[0, ctx.stage] for k, v in xs["rows"].items()})
        out = {}
        for p, kind in enumerate(ctx.schedule.phases):
            row = {k: v[p, ctx.stage] for k, v in xs["rows"].items()}
            at = xs["position"][p]
            row, at = (_stage_masks(row), at) if tab.masked else (row, at[ctx.stage])
            branches = [functools.partial(b, ctx) for b in phases[p]]
            writes, out_x, out_dy = jax.lax.switch(at, branches, state, row)
            state = apply(state, writes)
            out[kind] = out_x if kind == "F" else out_dy
        return _send(ctx, state, (out["F"], out["B"]), sends, xs["carry"]), None

    return body, {"rows": rows, "position": position.astype(np.int32)}


def _stage_masks(row: Row) -> Row:
    """A uniform phase's row with this stage's own flags: whether it acts, and whether on the
    first or the last chunk (``branch_index``'s encoding); the phase's variant runs on every
    stage, and these say which of its results are this stage's."""
    active = row["branch"] != IDLE
    _, first, last = branch_parts(row["branch"])
    return dict(row, active=active, first=active & first, last=active & last)


def _masked(row: Row, flag: str, tree: Any) -> Any:
    """``tree`` where this stage's ``flag`` holds, zeros elsewhere (branch form: ``tree``)."""
    if flag not in row:
        return tree
    return jax.tree.map(lambda a: jnp.where(row[flag], a, jnp.zeros_like(a)), tree)


def _pick(row: Row, flag: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """a where this stage's ``flag`` holds, else b (branch form: a)."""
    return a if flag not in row else jnp.where(row[flag], a, b)


Branch = tuple[Writes, jax.Array, jax.Array]


def _idle(ctx: _Context, state: dict[str, Any], row: Row, *, kinds: frozenset[int]) -> Branch:
    zeros = _zeros(state)
    return no_writes(state, row, kinds), zeros, zeros


def _chunk(ctx: _Context, row: Row) -> Any:
    return jax.tree.map(lambda a: a[row["virtual"]], ctx.stage_params)


def _micro(tree: Any, row: Row) -> Any:
    return jax.tree.map(lambda a: a[row["micro"]], tree)


def _embed(ctx: _Context, row: Row) -> tuple[jax.Array, Callable[..., Any]]:
    embed = ctx.ends.embed_fn
    return jax.vjp(lambda ep: embed(ep, _micro(ctx.inputs, row)), ctx.ends.embed_params)


def _forward(
    ctx: _Context, state: dict[str, Any], row: Row, *, first: bool, last: bool,
    kinds: frozenset[int],
) -> Branch:  # fmt: skip
    """F: the chunk's forward; its vjp residuals stashed; y sent on, or the loss taken."""
    writes, zeros = no_writes(state, row, kinds), _zeros(state)
    x = state["x_box"][jnp.maximum(row["x_in"], 0)]
    if first:
        x = _pick(row, "first", like(_embed(ctx, row)[0], zeros), x)
    p = _chunk(ctx, row)
    y, vjp, aux = jax.vjp(functools.partial(ctx.chunk_fn, m=row["micro"]), p, like(x, zeros),
                          has_aux=True)  # fmt: skip
    if aux is not None:  # the chunk's own loss term, and its metrics
        aux_loss, metrics = aux
        writes["loss"] = _masked(row, "active", like(aux_loss, state["loss"]))
        if metrics is not None:
            writes["metrics"] = typed(_masked(row, "active", metrics), state["metrics"])
    leaves = jax.tree.leaves(vjp)
    assert _param_mask(leaves, p) == ctx.keep, "stage_fn's residuals differ between traces"
    stashed = [leaf for leaf, k in zip(leaves, ctx.keep, strict=True) if k < 0]
    writes["stash"] = (row["stash"], typed(stashed, [b[0] for b in state["stash"]]))
    if "x_local" in row:  # ZBV's turn: the next chunk is on this stage
        writes["x_box"] = (row["x_local"], [like(y, zeros)])
    if not last:
        return writes, like(y, zeros), zeros
    loss_fn = ctx.ends.loss_fn
    loss, (d_loss_params, dy) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
        ctx.ends.loss_params, y, _micro(ctx.targets, row)
    )
    loss = _masked(row, "last", like(loss.astype(jnp.float32), state["loss"]))
    writes["loss"] = writes["loss"] + loss
    writes["loss_grads"] = typed(_masked(row, "last", d_loss_params), state["loss_grads"])
    writes["dy_box"] = (_pick(row, "last", row["dy_in"], jnp.int32(-1)), [like(dy, zeros)])
    return writes, _pick(row, "last", zeros, like(y, zeros)), zeros


def _vjp_leaves(ctx: _Context, state: dict[str, Any], row: Row) -> list[Any]:
    """The chunk's vjp leaves: its params, and the residuals its F stashed."""
    params = jax.tree.leaves(_chunk(ctx, row))
    stored = iter(buf[jnp.maximum(row["stash"], 0)] for buf in state["stash"])
    return [next(stored) if k < 0 else params[k] for k in ctx.keep]


def _backward(
    ctx: _Context, state: dict[str, Any], row: Row, *, first: bool, last: bool,
    kinds: frozenset[int],
) -> Branch:  # fmt: skip
    """B: the input gradient sent back (chunk 0: into the embedding). Unsplit schedules take
    the weight gradient here too; split ones run only the backward's input-gradient half and
    stash what W needs (``split.SplitBackward``)."""
    writes, zeros = no_writes(state, row, kinds), _zeros(state)
    dy = state["dy_box"][jnp.maximum(row["dy_in"], 0)]
    leaves = _vjp_leaves(ctx, state, row)
    if ctx.split is None:
        dp, dx = jax.tree.unflatten(ctx.vjp_def, leaves)(dy)
        writes = _weight_grads(ctx, state, row, writes, (dp, dx), first=first)
    else:
        dx, cut = ctx.split.input_grad(leaves, dy)
        writes["w_stash"] = (row["w_stash"], typed([*cut, dx], [b[0] for b in state["w_stash"]]))
    dx_out = like(dx, zeros)
    if "dy_local" in row:  # ZBV's turn: the previous chunk is on this stage
        writes["dy_box"] = (row["dy_local"], [dx_out])
    return writes, zeros, _pick(row, "first", zeros, dx_out) if first else dx_out


def _weights(
    ctx: _Context, state: dict[str, Any], row: Row, *, first: bool, last: bool,
    kinds: frozenset[int],
) -> Branch:  # fmt: skip
    """W (split schedules): the weight gradient of a chunk whose B already ran, from B's cut."""
    assert ctx.split is not None
    zeros = _zeros(state)
    dy = state["dy_box"][jnp.maximum(row["dy_in"], 0)]
    *cut, dx = (buf[jnp.maximum(row["w_stash"], 0)] for buf in state["w_stash"])
    dp = ctx.split.weight_grad(_vjp_leaves(ctx, state, row), dy, cut=cut)
    writes = _weight_grads(ctx, state, row, no_writes(state, row, kinds), (dp, dx), first=first)
    return writes, zeros, zeros


def _weight_grads(
    ctx: _Context, state: dict[str, Any], row: Row, writes: Writes, grads: Any, *, first: bool
) -> Writes:
    """``writes`` with the chunk's weight gradient added (``grads``: dp, dx; chunk 0: the
    embedding's too, by its vjp re-run on this microbatch's input, applied to dx)."""
    dp, dx = grads
    per_chunk = jax.tree.map(lambda a: a[0], state["grads"])
    writes = dict(writes, grads=(row["virtual"], typed(_masked(row, "active", dp), per_chunk)))
    if first:
        (d_embed,) = _embed(ctx, row)[1](like(dx, state["x_box"]))
        writes["embed_grads"] = typed(_masked(row, "first", d_embed), state["embed_grads"])
    return writes


def _scoped(branch: Callable[..., Branch], index: int) -> Callable[..., Branch]:
    def run(*args: Any) -> Branch:
        with jax.named_scope(BRANCH_SCOPE.format(index)):
            return branch(*args)

    return run


# ----------------------------------------------------------------------------- helpers


def _permute_axes_of(fn: Callable[..., Any], *args: Any) -> set[str]:
    """The axes of every ``ppermute`` ``fn`` (a chunk, the embedding or the loss, with their
    backward) runs: the branch form cannot run one (module docstring)."""
    return _permute_axes(jax.make_jaxpr(fn)(*args).jaxpr)


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


def _zeros(state: dict[str, Any]) -> jax.Array:
    """An activation of zeros, typed as the inbox's."""
    return jnp.zeros_like(state["x_box"][0])


def _param_mask(leaves: list[Any], params: Any) -> tuple[int, ...]:
    """Per vjp leaf: the index of the chunk param it is, or −1 if it must be stashed."""
    param_ids = {id(p): i for i, p in enumerate(jax.tree.leaves(params))}
    return tuple(param_ids.get(id(leaf), -1) for leaf in leaves)
