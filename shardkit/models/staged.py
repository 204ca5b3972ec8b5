"""Pipelining any model: ``Stages`` says how a model cuts into stages, and ``ShardedModel``
(``pipeline=Stages(...)``) runs its gradients through ``parallel.pipeline``'s engine.

You give the schedule (``parallel.pipeline.schedules.build``) and three functions:

  embed_fn  ``(embed_params, input_m) -> x``             before chunk 0 (stage 0)
  stage_fn  ``(chunk_params, x) -> y``                   one chunk: its layers, y typed like x
            ``(chunk_params, x, side_m) -> y``          with side inputs (below)
            ``... -> (y, aux_loss)``                     with ``aux=True``: a scalar term of
            the loss (a MoE layer's balance losses, this microbatch's share), summed into
            the loss with its gradient
            ``... -> (y, aux_loss, counts)``             and a pytree summed over every
            chunk's forward (routing counts): give ``metrics``, ``(summed counts, this
            device's targets) -> {name: value}``, the step's metrics beside its loss
  loss_fn   ``(head_params, y, target_m) -> share``      after the last chunk: this
            microbatch's share of the GLOBAL loss (divide by the global batch yourself, or
            give ``divisor``: ``(targets) -> the global divisor``, computed once per step
            from this device's targets of every microbatch, e.g. the global count of real
            targets when some are padding)

and which params each reads: ``layers`` names the top-level subtree of stacked layers
``[L, ...]`` (its logical axis, e.g. ``"layers"``, mapped to ``stage`` by your rules);
``embed`` and ``head`` the top-level keys the ends read (a key in both is tied: its two
gradients are added before the all-reduce over stage the engine already makes, which sends it
once).

Placement: device s of the stage axis holds chunks s, s+S, ... (``pipeline.layer_order``):
``ShardedModel.shard`` stores the layers so and ``to_reference`` maps any params-shaped tree
(gradients) back to your order. The batch inputs are ``(inputs, targets, *side)``, each split
into M microbatches of the data-local batch; the side inputs (packed documents' segment ids
and positions) reach every chunk of their microbatch as the tuple ``side_m``, on every stage.
Sharding signature, per device of (data, stage):

  the layers[L_stage, ...] · inputs[B_data, ...] · targets[B_data, ...] · side[B_data, ...]
    -> loss (invariant), grads like params (layers split over stage, ends whole)

Composes with data parallelism, FSDP / ZeRO-1 (every split leaf gathered once per step before
the schedule, its gradient reduce-scattered once after it) and any collective inside a chunk.
A ``ppermute`` there makes the engine run the schedule's uniform form (``parallel.pipeline``);
give ``schedules.uniform(schedule)`` as the schedule so that per-stage reports (``stage_ledger``)
count what runs. ZeRO-2 is refused: the schedule sums a layer's gradients over microbatches
before they are whole.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jaxtyping import Array

from shardkit.comm.ledger import Ledger
from shardkit.comm.report import Report
from shardkit.comm.terms import Expectation
from shardkit.mesh import PlanError
from shardkit.parallel import data as dp
from shardkit.parallel import pipeline
from shardkit.parallel.pipeline.engine import EmbedFn, LossFn, StageFn
from shardkit.parallel.pipeline.schedules import Schedule
from shardkit.parallel.vma import vary, varying_axes

if TYPE_CHECKING:
    from shardkit.models.sharded import ShardedModel

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Stages:
    """How a model cuts into pipeline stages (the module docstring says what each part is)."""

    schedule: Schedule
    embed_fn: EmbedFn
    stage_fn: StageFn
    loss_fn: LossFn
    layers: str = "layers"
    embed: tuple[str, ...] = ()
    head: tuple[str, ...] = ()
    axis: str = "stage"
    divisor: Callable[[Any], Array] | None = None
    aux: bool = False
    metrics: Callable[[Any, Array], dict[str, Array]] | None = None

    def order(self, depth: int) -> np.ndarray:
        """order[p] = your layer stored at position p (``pipeline.layer_order``)."""
        sched = self.schedule
        return pipeline.layer_order(depth, sched.stages, sched.virtual, sched.name == "zbv")

    def to_stage_order(self, tree: PyTree) -> PyTree:
        """A params-shaped tree with its layers in the order the stages hold them."""
        return self._reordered(tree, inverse=False)

    def to_reference(self, tree: PyTree) -> PyTree:
        """A params-shaped tree (params, gradients) with its layers back in your order."""
        return self._reordered(tree, inverse=True)

    def _reordered(self, tree: PyTree, inverse: bool) -> PyTree:
        depth = jax.tree.leaves(tree[self.layers])[0].shape[0]
        order = self.order(depth)
        if np.array_equal(order, np.arange(depth)):
            return tree
        order = np.argsort(order) if inverse else order
        return {**tree, self.layers: jax.tree.map(lambda a: a[order], tree[self.layers])}


def check(model: ShardedModel, stages: Stages) -> None:
    """PlanError (one sentence) unless ``model``'s mesh, ZeRO level and params fit ``stages``."""
    n = model.mesh.shape.get(stages.axis)
    if n != stages.schedule.stages:
        raise PlanError(
            f"The schedule has {stages.schedule.stages} stages but the mesh's {stages.axis!r} "
            f"axis has {n} devices."
        )
    if model.zero == 2 and model.batch_axes:
        raise PlanError(
            "ZeRO-2 cannot run under a pipeline: the schedule sums each layer's gradients over "
            "the microbatches before they are whole; use ZeRO-1 or 3."
        )
    if len(model.batch_specs) < 2:
        raise PlanError(
            f"A pipelined model takes at least two batch inputs (inputs, targets, *side), not "
            f"{len(model.batch_specs)}."
        )


def grads_local(
    model: ShardedModel, stages: Stages, params: PyTree, inputs: Array, targets: Array, *side: Array
) -> tuple[Array, PyTree]:
    """Inside shard_map: (global loss, synced gradients) of ``model`` run by the schedule.

    Params are cast varying over their sync axes (as without a pipeline), FSDP-gathered once
    (this device's layers and the ends), run by ``pipeline.pipeline_grads`` on M microbatches,
    and their gradients reduce-scattered by the gather's transpose and synced by
    ``model.finish_grads``.
    """
    sched, micro = stages.schedule, stages.schedule.micro
    dims = model.gather_dims()
    axis = model.batch_axes[0] if model.batch_axes else "data"

    def gathered(p: PyTree) -> PyTree:
        return dp.fsdp_gather(p, dims, axis, tiles=model.fsdp_tiles) if model.batch_axes else p

    whole, scatter = jax.vjp(gathered, dp.vary(params, model.vary_axes))
    ends = pipeline.Ends(
        stages.embed_fn, {k: whole[k] for k in stages.embed},
        _divided(stages, targets), {k: whole[k] for k in stages.head},
        tied=tuple(k for k in stages.embed if k in stages.head),
    )  # fmt: skip
    total, d_chunks, d_embed, d_head = pipeline.pipeline_grads(
        sched, stages.stage_fn, chunks(whole[stages.layers], sched.virtual), ends,
        microbatches(inputs, micro), microbatches(targets, micro), axis=stages.axis,
        side=tuple(microbatches(a, micro) for a in side) if side else None, aux=stages.aux,
    )  # fmt: skip
    layers = whole[stages.layers]
    d_whole = {stages.layers: jax.tree.map(lambda g, w: g.reshape(w.shape), d_chunks, layers)}
    for k in {*stages.embed, *stages.head}:
        parts = [d[k] for d in (d_embed, d_head) if k in d]
        d_whole[k] = parts[0] if len(parts) == 1 else jax.tree.map(lambda a, b: a + b, *parts)
    (grads,) = scatter(jax.tree.map(_typed_like, {k: d_whole[k] for k in whole}, whole))
    synced, _ = model.finish_grads(grads)
    return _with_metrics(model, stages, total, targets), synced


def _with_metrics(model: ShardedModel, stages: Stages, total: Any, targets: Array) -> Any:
    """The global loss, or with ``stages.metrics`` {"loss": it, **the metrics}."""
    if stages.metrics is None:
        return model.total_loss(total)
    loss, summed = total
    return {"loss": model.total_loss(loss), **stages.metrics(summed, targets)}


def _divided(stages: Stages, targets: Array) -> Callable[..., Array]:
    """The loss function, its shares divided by ``stages.divisor(targets)`` if given."""
    if stages.divisor is None:
        return stages.loss_fn
    divisor = stages.divisor(targets)
    return lambda head, y, target_m: stages.loss_fn(head, y, target_m) / divisor


def microbatches(x: Array, micro: int) -> Array:
    """[b, ...] -> [M, b/M, ...]: microbatch m holds local examples m·b/M ... (m+1)·b/M − 1."""
    return x.reshape(micro, x.shape[0] // micro, *x.shape[1:])


def chunks(layers: PyTree, virtual: int) -> PyTree:
    """This device's layers [V·n, ...] (in stage order) as V chunks [V, n, ...]."""
    return jax.tree.map(lambda a: a.reshape(virtual, a.shape[0] // virtual, *a.shape[1:]), layers)


def _typed_like(g: Array, ref: Array) -> Array:
    """A gradient typed as its primal: cast varying over the primal's axes (the engine types
    it over more, e.g. ``stage`` for the embedding's after its sum over stage, or ``data``),
    and summed over the size-1 axes only the inputs vary over (a batch spec naming every
    token axis, as the GPT's does: a no-op sum)."""
    extra = tuple(sorted(varying_axes(g) - varying_axes(ref)))
    if extra:
        sizes = {a: jax.lax.axis_size(a) for a in extra}
        assert all(n == 1 for n in sizes.values()), f"gradient varies over {sizes}"
        g = jax.lax.psum(g, extra)
    return vary(g, varying_axes(ref))


# A collective inside a branch: its op_name holds the engine's segment scope, then its branch's.
_BRANCH = re.compile(
    pipeline.SEGMENT_SCOPE.format(r"(\d+)")
    + "/(?:.*/)?"
    + pipeline.BRANCH_SCOPE.format(r"(\d+)")
    + "/"
)


def stage_ledger(ledger: Ledger, sched: Schedule, stage: int) -> Ledger:
    """``ledger`` as one stage's device runs it: a collective or matmul inside a schedule
    branch counts the ticks this stage spends in that branch, not every tick of its segment
    (the ledger counts every branch of a conditional as if it ran; ``pipeline.branch_runs``).

    Raises:
      ValueError: a branch op's count is not a multiple of its segment's length (XLA
        restructured the tick loop, so the per-stage count cannot be read).
    """
    runs = pipeline.branch_runs(sched)
    collectives = [_on_stage(c, runs, stage) for c in ledger.collectives]
    matmuls = [_on_stage(m, runs, stage) for m in ledger.matmuls]
    return dataclasses.replace(
        ledger,
        collectives=tuple(c for c in collectives if c.count),
        matmuls=tuple(m for m in matmuls if m.count),
    )


def _on_stage(op: Any, runs: dict[tuple[int, int], Any], stage: int) -> Any:
    """A ledger record (``Collective`` or ``Matmul``) with its count as ``stage`` runs it."""
    match = _BRANCH.search(op.op_name)
    if not match:
        return op
    k, b = int(match.group(1)), int(match.group(2))
    length = int(runs[(k, -1)][stage])
    if op.count % length:
        raise ValueError(
            f"{op.name} in pipeline segment {k} runs {op.count} times, not a multiple of the "
            f"segment's {length} ticks."
        )
    ran = int(runs[(k, b)][stage]) if (k, b) in runs else 0
    return dataclasses.replace(op, count=op.count // length * ran)


def stage_report(
    ledger: Ledger, sched: Schedule, expectation: Callable[[int], Expectation]
) -> Report:
    """A pipelined step's report: each stage's ledger (``stage_ledger``) against that stage's
    ``expectation(stage)``; the last stage shown, the others (``Report.others``) checked too."""
    reports = [Report(stage_ledger(ledger, sched, s), expectation(s)) for s in range(sched.stages)]
    return dataclasses.replace(reports[-1], others=tuple(enumerate(reports[:-1])))
