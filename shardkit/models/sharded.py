"""Any model on a mesh: specs, gradient sync, optimizer layout and a train step, derived.

The generic layer under every sharded model here (``ShardedViT`` is one user of it). You give:

  param_axes   per param leaf, a tuple of logical names per dim, e.g. ``("embed", "mlp")``;
  rules        logical name -> mesh axis, e.g. ``{"mlp": "model", "heads": "model"}``
               (add ``"embed": "data"`` for FSDP);
  loss_local   ``(params_local, *batch_local) -> share``: this device's share of the loss,
               run inside ``shard_map`` on the local blocks of params and batch; ``aux=True``:
               ``(share, metrics)``, values the same on every device (a MoE's token counts),
               reported beside the loss (``loss_and_grads`` returns ``{"loss", **metrics}``);
  batch_specs  one ``PartitionSpec`` per batch input (default: dim 0 over ``batch_axes``);
  token_axes   the mesh axes your forward splits tokens over (sequence parallelism; the
               ``expert`` axis: the leaves split over it, the experts', sync over the rest);
  token_free   path prefixes of the leaves used only after tokens are reduced (a classifier
               head after pooling), whose gradients are therefore whole on every token shard;
  gather       FSDP (a rule maps a name to a batch axis): True all-gathers every split leaf
               before ``loss_local`` runs; False leaves it to ``loss_local``
               (``data.fsdp_gather(p, model.gather_dims(...))`` one layer at a time, as
               ``ShardedViT`` does, so only one layer's weights are ever whole).
  zero         what the batch-axis rules split (the ZeRO level): 3 (default) the params
               themselves (FSDP, as above); 1 only the optimizer state (params replicated,
               gradients reduce-scattered when backward is done, params all-gathered after
               the update, the whole step in one ``shard_map``); 2 also the gradients,
               reduce-scattered as backward makes them (``data.zero_attach``; a model with a
               layer loop overrides ``zero2_loss_local`` to attach per layer, as
               ``ShardedViT`` does).
  pipeline     a ``staged.Stages``: the model cut into embed / stage / loss functions and
               run by a pipeline schedule over ``stage`` (``models.staged`` says how); the
               batch is then (inputs, targets).
  accumulate   M: each step runs the local batch as M micro-batches, one after another,
               gradients summed before the one sync (``data.accumulate``; not with a pipeline,
               whose ``Stages`` have microbatches of their own).
  remat        what the backward recomputes in the blocks ``loss_local`` marks with
               ``parallel.remat.block``: "none" (default), "dots" or "full" (``remat.POLICIES``).
  compute_dtype  mixed precision: ``"bfloat16"`` hands ``loss_local`` its params cast to bf16
               (after any FSDP gather, so the bytes moved are the plan's), while the params,
               gradients and optimizer state stay float32; ``keep_float32`` lists path
               prefixes of leaves that stay float32 (norm scales, say). What the forward
               computes in which dtype beyond its params is ``loss_local``'s choice.
  grad_sync    the dtype the gradient all-reduces travel in: "float32" or "bfloat16" (as
               XLA's partitioner sends a bf16 model's: ``data.narrowed``).

and get, per leaf, its ``PartitionSpec``, the axes its gradient is a partial sum over
(``sync_axes``), the dim FSDP gathers (``gather_dims``), the optimizer state sharded like the
params, a divisibility check that names the leaf, and a jitted, donated train step.

The loss convention: the global loss is the sum of the devices' shares over the mesh axes the
share is typed varying over (``check_vma``'s type, read at trace time) — divide by the
*global* batch (and token count) inside ``loss_local``. A share that is invariant over an axis
(a classifier's loss after pooling over ``seq``) is counted once, not n times.

Gradients (all collectives visible, none implicit): each leaf is cast varying over its
``sync_axes`` before autodiff (``data.vary``), so autodiff leaves those partial sums alone, and
``data.sync_grads`` all-reduces them once per bucket. A leaf split over a batch axis (FSDP) is
all-gathered before use (``data.fsdp_gather``) and its
gradient arrives reduce-scattered (the transpose), so it is not synced there; with
``gather=True`` the layer does that gather for you, for every leaf at once.

Mistakes and what catches them: a leaf used on token shards but listed in ``token_free`` makes
``check_vma`` insert one implicit all-reduce per use — ``comm.contract.assert_contract`` refuses
implicit collectives by default; a leaf listed as used on token shards that is not (its
gradient already whole) is summed n times over — ``testing.compare_sharded`` names it.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from shardkit.mesh import (
    GRAD_SYNC,
    PlanError,
    check_divisible,
    leaf_path,
    logical_specs,
    spec_axes,
    without_axes,
)
from shardkit.models import staged
from shardkit.parallel import data as dp
from shardkit.parallel import remat as remat_policies
from shardkit.parallel.tiles import tiles_for

PyTree = Any
Axes = tuple[str, ...]
LossLocal = Callable[..., Array]


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


# ----------------------------------------------------------------------------- derivations


def mesh_rules(rules: Mapping[str, str], mesh: Mesh) -> dict[str, str]:
    """``rules`` restricted to mesh axes of size > 1 (a size-1 axis splits nothing).

    Raises:
      PlanError: a rule names an axis the mesh lacks.
    """
    for name, axis in rules.items():
        if axis not in mesh.shape:
            raise PlanError(
                f"Rule {name!r} -> {axis!r} names a mesh axis this mesh lacks "
                f"(axes: {', '.join(mesh.axis_names)})."
            )
    return {name: axis for name, axis in rules.items() if mesh.shape[axis] > 1}


def grad_sync_axes(
    specs: PyTree,
    mesh: Mesh,
    batch_axes: Axes = ("data",),
    token_axes: Axes = (),
    token_free: Sequence[str] = (),
) -> PyTree:
    """Per leaf, the mesh axes (size > 1) its gradient is a partial sum over.

    Every batch axis the leaf is not split over (over one it is split over — FSDP — its
    gradient is reduce-scattered by the transpose of its gather), and every token axis the leaf
    is not split over unless its path starts with one of ``token_free``. A leaf split over a
    token axis (an expert's weights over ``expert``, where tokens come to their expert by
    all-to-all) is whole there: it is synced over the other axes only, never over that one.
    """
    big = {a for a, n in mesh.shape.items() if n > 1}

    def axes(path: tuple[Any, ...], spec: P) -> Axes:
        split = set(spec_axes(spec))
        out = [a for a in batch_axes if a in big and a not in split]
        name = leaf_path(path)
        if not any(name == f or name.startswith(f + "/") for f in token_free):
            out += [a for a in token_axes if a in big and a not in split]
        return tuple(out)

    return jax.tree_util.tree_map_with_path(axes, specs, is_leaf=_is_spec)


def gather_dims(specs: PyTree, axis: str = "data", drop_leading: int = 0) -> PyTree:
    """Per leaf, the dim split over ``axis`` (FSDP's), or None: ``data.fsdp_gather``'s input.

    ``drop_leading`` shifts the dims for leaves indexed inside a ``lax.scan`` over a stacked
    leading axis (the per-layer slice has one dim fewer).
    """

    def dim(spec: P) -> int | None:
        for i, entry in enumerate(spec):
            if axis in spec_axes(P(entry)):
                return i - drop_leading
        return None

    return jax.tree.map(dim, specs, is_leaf=_is_spec)


# ----------------------------------------------------------------------------- the model


class ShardedModel:
    """A user's model on ``mesh``: place params, loss and gradients, a donated train step.

    ``model = ShardedModel(mesh, param_axes, rules, loss_local, token_axes=("seq",))``;
    ``params = model.shard(params)``; ``model.loss_and_grads(params, *batch)``;
    ``model.train_step(optimizer, clip_norm=1.0)(params, opt_state, *batch)``. Compiled
    functions are built once per instance and shared. See the module docstring for what each
    argument means and which mistakes are caught where.
    """

    def __init__(
        self,
        mesh: Mesh,
        param_axes: PyTree,
        rules: Mapping[str, str],
        loss_local: LossLocal | None = None,
        *,
        batch_specs: Sequence[P] | None = None,
        batch_axes: Axes = ("data",),
        token_axes: Axes = (),
        token_free: Sequence[str] = (),
        gather: bool = True,
        zero: int = 3,
        pipeline: staged.Stages | None = None,
        compute_dtype: str | None = None,
        keep_float32: Sequence[str] = (),
        aux: bool = False,
        remat: str = "none",
        grad_sync: str = "float32",
        accumulate: int = 1,
    ) -> None:
        _check_arguments(mesh, (*batch_axes, *token_axes), loss_local, pipeline, aux,
                         accumulate)  # fmt: skip
        _check_choices(zero=zero, compute_dtype=compute_dtype, grad_sync=grad_sync)
        self.accumulate = accumulate
        self.compute_dtype, self.keep_float32, self.aux = compute_dtype, tuple(keep_float32), aux
        self.grad_sync = grad_sync
        try:
            self.remat = remat_policies.check(remat)
        except ValueError as err:
            raise PlanError(str(err)) from None
        self.mesh, self.param_axes = mesh, param_axes
        self.loss_local = loss_local  # None for a pipelined model: its stages compute it
        self.rules = mesh_rules(rules, mesh)
        self.batch_axes = tuple(a for a in batch_axes if mesh.shape[a] > 1)
        # The optimizer state (and the synced gradients) are split as the rules say; the params
        # too under ZeRO-3, replicated over the batch axes under ZeRO-1 and ZeRO-2.
        self.state_specs = logical_specs(param_axes, self.rules)
        self.zero = zero
        self.specs = (
            self.state_specs if zero == 3 else without_axes(self.state_specs, self.batch_axes)
        )
        self.token_axes = tuple(token_axes)
        default = P(self.batch_axes) if self.batch_axes else P()
        self.batch_specs = tuple(batch_specs) if batch_specs is not None else (default,)
        _warn_unsplit_batch(self.batch_specs, self.batch_axes)
        self.sync_axes = grad_sync_axes(self.state_specs, mesh, batch_axes, token_axes, token_free)
        self.gather = gather
        # On a TPU: FSDP's and ZeRO's buckets as the tiles its compiler keeps (parallel.tiles).
        self.fsdp_tiles = tiles_for(mesh)
        self.pipeline = pipeline
        if pipeline is not None:
            staged.check(self, pipeline)
        self._steps: dict[tuple[Any, float | None], Callable[..., Any]] = {}

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def gather_dims(self, subtree: str | None = None, drop_leading: int = 0) -> PyTree:
        """``gather_dims`` of the specs (or of ``specs[subtree]``) over the batch axis."""
        specs = self.specs if subtree is None else self.specs[subtree]
        axis = self.batch_axes[0] if self.batch_axes else "data"
        return gather_dims(specs, axis, drop_leading)

    @property
    def zero_axis(self) -> str | None:
        """The batch axis ZeRO-1/2 split the optimizer state over (None: no ZeRO-1/2)."""
        return self.batch_axes[0] if self.zero in (1, 2) and self.batch_axes else None

    @property
    def zero_dims(self) -> PyTree:
        """Per leaf, the dim ZeRO-1/2 split its state and gradient along, or None (kept whole)."""
        return gather_dims(self.state_specs, self.zero_axis or "data")

    @property
    def vary_axes(self) -> PyTree:
        """Per leaf, the axes params are cast varying over before autodiff: the sync axes, and
        under ZeRO-1/2 the batch axis of the split leaves (reduce-scattered, not synced)."""
        axis = self.zero_axis
        if axis is None:
            return self.sync_axes

        def axes(sync: Axes, dim: int | None) -> Axes:
            return sync if dim is None else (*sync, axis)

        return jax.tree.map(
            axes, self.sync_axes, self.zero_dims, is_leaf=lambda x: isinstance(x, tuple)
        )

    def check_params(self, params: PyTree) -> None:
        """PlanError naming the leaf, dim and axis if a split dim does not divide."""
        check_divisible(params, self.state_specs, self.param_axes, self.mesh)

    def check_inputs(self, *batch: Any) -> None:
        """PlanError naming the input and dim if a batch input does not divide its spec."""
        if len(batch) != len(self.batch_specs):
            raise PlanError(
                f"{len(batch)} batch inputs given, {len(self.batch_specs)} batch_specs declared."
            )
        for i, (x, spec) in enumerate(zip(batch, self.batch_specs, strict=True)):
            for dim, entry in enumerate(spec):
                axes = spec_axes(P(entry))
                n = math.prod(self.mesh.shape[a] for a in axes)
                if x.shape[dim] % n:
                    split = "×".join(f"{a}={self.mesh.shape[a]}" for a in axes)
                    raise PlanError(
                        f"Batch input {i} dim {dim} (size {x.shape[dim]}) is not divisible by "
                        f"{split}."
                    )
            local = x.shape[0] // math.prod(self.mesh.shape[a] for a in spec_axes(P(*spec[:1])))
            if local % self.accumulate:
                raise PlanError(f"Batch input {i}'s local batch ({local}) is not divisible by "
                                f"accumulate={self.accumulate} micro-batches.")  # fmt: skip

    def shard(self, params: PyTree) -> PyTree:
        """Places a copy of ``params`` on the mesh, each leaf split per its spec (checked first).

        Always a copy (never aliasing ``params``' buffers), so donating the result to
        ``train_step`` leaves the caller's arrays alive.
        """
        self.check_params(params)
        if self.pipeline is not None:  # device s holds chunks s, s+S, ... of the layers
            params = self.pipeline.to_stage_order(params)
        # An explicit copy: device_put(may_alias=False) still reuses a source buffer that already
        # lives on a target device (measured on jax 0.10.2), and donation would then delete it.
        shardings = jax.tree.map(self.sharding, self.specs, is_leaf=_is_spec)
        return jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings)(params)

    def abstract_args(
        self, optimizer: optax.GradientTransformation, params: PyTree, *batch: Any
    ) -> tuple[Any, ...]:
        """``train_step``'s arguments (params, optimizer state, *batch) as shapes carrying
        this model's shardings: ``train_step(opt).lower(*abstract_args(...)).compile()`` needs
        no data and no devices to run on (a TPU slice's: ``run.target.topology_devices``)."""
        abstract = lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)  # noqa: E731

        shapes = jax.eval_shape(lambda p: p, params)
        if self.pipeline is not None:
            shapes = jax.eval_shape(self.pipeline.to_stage_order, shapes)
        placed = jax.tree.map(lambda x, s: abstract(x, self.sharding(s)), shapes, self.specs)
        state, shardings = dp.opt_state_layout(optimizer, shapes, self.state_specs, self.sharding)
        pairs = zip(batch, self.batch_specs, strict=True)
        inputs = tuple(abstract(x, self.sharding(s)) for x, s in pairs)
        return placed, jax.tree.map(abstract, state, shardings), *inputs

    def to_reference(self, tree: PyTree) -> PyTree:
        """A params-shaped tree of this model (params, gradients) in your layer order: the
        identity unless a pipeline with virtual chunks stores the layers in stage order."""
        return tree if self.pipeline is None else self.pipeline.to_reference(tree)

    def shard_batch(self, *arrays: Array) -> tuple[Array, ...]:
        """Places each batch input per its spec (checked first)."""
        self.check_inputs(*arrays)
        pairs = zip(arrays, self.batch_specs, strict=True)
        return tuple(jax.device_put(a, self.sharding(s)) for a, s in pairs)

    def shard_map(self, body: Callable[..., Any], in_specs: Any, out_specs: Any) -> Any:
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

    # ------------------------------------------------------------------------- per device

    def _loss_gathered(self, params: PyTree, *batch: Array) -> Any:
        """``loss_local`` on params whose FSDP-split leaves are whole (if ``gather``): the
        share, or (share, metrics) with ``aux``."""
        if self.gather and self.batch_axes:
            params = dp.fsdp_gather(
                params, self.gather_dims(), self.batch_axes[0], tiles=self.fsdp_tiles
            )
        assert self.loss_local is not None, "a pipelined model's loss runs in staged.grads_local"
        with remat_policies.policy(self.remat):
            return self.loss_local(self.compute_params(params), *batch)

    def compute_params(self, params: PyTree) -> PyTree:
        """``params`` as the forward sees them: float leaves cast to ``compute_dtype`` but
        those under a ``keep_float32`` prefix (autodiff casts the gradients back)."""
        if self.compute_dtype in (None, "float32"):
            return params
        dtype = jnp.dtype(self.compute_dtype)

        def cast(path: tuple[Any, ...], x: Array) -> Array:
            name = leaf_path(path)
            keep = any(name == k or name.startswith(k + "/") for k in self.keep_float32)
            return x if keep or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)

        return jax.tree_util.tree_map_with_path(cast, params)

    def zero2_loss_local(self, frags: PyTree, params: PyTree, *batch: Array) -> Any:
        """ZeRO-2's loss: ``loss_local`` on ``params`` whose gradients go to ``frags``,
        reduce-scattered once backward is done (override to attach them layer by layer)."""
        attached = dp.zero_attach(
            params, frags, self.zero_dims, self.batch_axes[0], tiles=self.fsdp_tiles
        )
        return self._loss_gathered(attached, *batch)

    def loss_and_grads_local(self, params: PyTree, *batch: Array) -> tuple[Any, PyTree]:
        """Inside shard_map: (global loss, synced gradients sharded like ``state_specs``); with
        ``aux`` the loss is ``{"loss": loss, **metrics}``."""
        if self.pipeline is not None:
            with remat_policies.policy(self.remat):
                return staged.grads_local(self, self.pipeline, params, *batch)
        # Cast params varying over the axes their gradients are partial sums over, so autodiff
        # leaves those sums alone and sync_grads reduces them explicitly, bucketed.
        params = dp.vary(params, self.vary_axes)
        if self.zero == 2 and self.zero_axis:
            frags = dp.zero_slices(params, self.zero_dims, self.zero_axis)
            grad_fn = jax.value_and_grad(self.zero2_loss_local, has_aux=self.aux)
            out, grads = dp.accumulate(
                lambda f, *b: grad_fn(f, params, *b), frags, batch, self.accumulate
            )
        else:
            grad_fn = jax.value_and_grad(self._loss_gathered, has_aux=self.aux)
            out, grads = dp.accumulate(grad_fn, params, batch, self.accumulate)
        share, metrics = (out, None) if not self.aux else out
        grads, loss = self.finish_grads(grads, share)
        return (loss, grads) if metrics is None else ({"loss": loss, **metrics}, grads)

    def finish_grads(self, grads: PyTree, share: Array | None = None) -> tuple[PyTree, Any]:
        """Raw gradients to synced ones: ZeRO-1's reduce-scatter, then ``sync_grads_local``;
        returns (gradients, the global loss from this device's ``share`` of it, or None)."""
        if self.zero == 1 and self.zero_axis:
            grads = dp.zero_scatter(grads, self.zero_dims, self.zero_axis, tiles=self.fsdp_tiles)
        return self.sync_grads_local(grads, share)

    def sync_grads_local(self, grads: PyTree, share: Array | None = None) -> tuple[PyTree, Any]:
        """(gradients, loss) as ``riding`` sums them over the ``sync_axes``; a model whose
        gradients are disjoint slices somewhere overrides it to gather those instead."""
        return self.riding(grads, self.sync_axes, share)

    def riding(self, grads: PyTree, axes: PyTree, share: Array | None) -> tuple[PyTree, Any]:
        """(``grads`` summed over ``axes`` in ``grad_sync``'s dtype, returned in their own; the
        loss ``share`` summed over the axes it differs on, or None). The float32 share rides in
        the gradient bucket of those axes: one all-reduce on every compiler (the TPU compiler
        kept a loss all-reduce of its own apart: ViT-B/16's DP sent 2)."""
        tree, tree_axes = {"grads": dp.narrowed(grads, self.grad_sync)}, {"grads": axes}
        if share is not None:
            tree["loss"] = share
            tree_axes["loss"] = tuple(
                a for a in self.mesh.axis_names if a in dp.varying_axes(share)
            )
        synced = dp.sync_grads(tree, tree_axes)
        return dp.cast_like(synced["grads"], grads), synced.get("loss")

    def total_loss(self, share: Array) -> Array:
        """The loss value (for logging): the sum of the shares over the axes they differ on."""
        varying = dp.varying_axes(share)
        axes = tuple(a for a in self.mesh.axis_names if a in varying)
        return jax.lax.psum(share, axes) if axes else share

    @property
    def split_axes(self) -> PyTree:
        """Per gradient leaf, the mesh axes it is split over (for ``data.global_norm``)."""
        return jax.tree.map(spec_axes, self.state_specs, is_leaf=_is_spec)

    @property
    def reduce_axes(self) -> Axes:
        """The mesh axes of size > 1: the group a whole-model reduction (the norm) spans."""
        return tuple(a for a, n in self.mesh.shape.items() if n > 1)

    def clipped_grads_local(self, clip_norm: float, params: PyTree, *batch: Array):
        """Inside shard_map: (loss, gradients clipped to ``clip_norm``, global gradient norm)."""
        loss, grads = self.loss_and_grads_local(params, *batch)
        norm = dp.global_norm(grads, self.split_axes, self.reduce_axes)
        return loss, dp.clip_by_norm(grads, norm, clip_norm), norm

    # ------------------------------------------------------------------------- compiled

    def _grads_map(self, clip_norm: float | None) -> Callable[..., Any]:
        """shard_map of (params, *batch) -> (loss, grads[, grad_norm])."""
        in_specs = (self.specs, *self.batch_specs)
        if clip_norm is None:
            return self.shard_map(self.loss_and_grads_local, in_specs, (P(), self.state_specs))
        body = functools.partial(self.clipped_grads_local, clip_norm)
        return self.shard_map(body, in_specs, (P(), self.state_specs, P()))

    @functools.cached_property
    def loss_and_grads(self) -> Callable[..., tuple[Array, PyTree]]:
        """Jitted ``(params, *batch) -> (loss, grads)``; grads sharded like ``state_specs``
        (like the params, but split over the batch axis under ZeRO-1/2)."""
        return jax.jit(self._grads_map(None))

    def init_opt_state(self, optimizer: optax.GradientTransformation, params: PyTree) -> Any:
        """The optimizer state, each param-shaped leaf sharded like ``state_specs``."""
        _, shardings = dp.opt_state_layout(optimizer, params, self.state_specs, self.sharding)
        return jax.jit(optimizer.init, out_shardings=shardings)(params)

    def train_step(
        self, optimizer: optax.GradientTransformation, clip_norm: float | None = None
    ) -> Callable[..., Any]:
        """Jitted ``(params, opt_state, *batch) -> (params, opt_state, metrics)``.

        params and opt_state are donated. ``metrics`` holds ``loss``; with ``clip_norm`` also
        ``grad_norm``, the global gradient norm computed inside the shard_map from the sharded
        gradients (``data.global_norm``: one scalar all-reduce over every axis of size > 1),
        and the gradients are clipped to it as ``optax.clip_by_global_norm(clip_norm)`` would
        (``float("inf")`` reports the norm and never clips). The update is elementwise on
        arrays sharded like their params, so it adds no communication. Under ZeRO-1/2 the whole
        step is one ``shard_map`` (``zero_step_local``): the update runs on this device's slice
        and the params are all-gathered after it.
        """
        key = (optimizer, clip_norm)  # the optimizer is kept alive by the cache: never confused
        if key not in self._steps and self.zero_axis:
            self._steps[key] = self._zero_step(optimizer, clip_norm)
        if key not in self._steps:
            grad_fn = self._grads_map(clip_norm)

            def step(params: PyTree, opt_state: Any, *batch: Array):
                loss, grads, *norm = grad_fn(params, *batch)
                params, opt_state = dp.optax_update(optimizer, grads, opt_state, params)
                metrics = _metrics(loss) | ({"grad_norm": norm[0]} if norm else {})
                return params, opt_state, metrics

            self._steps[key] = jax.jit(step, donate_argnums=(0, 1))
        return self._steps[key]

    def zero_step_local(
        self,
        optimizer: optax.GradientTransformation,
        clip_norm: float | None,
        params: PyTree,
        opt_state: Any,
        *batch: Array,
    ) -> tuple[PyTree, Any, dict[str, Array]]:
        """Inside shard_map, ZeRO-1/2: gradients reduce-scattered (and clipped from their
        slices), this device's slice updated with its state slice, params all-gathered."""
        if clip_norm is None:
            loss, grads = self.loss_and_grads_local(params, *batch)
            metrics = _metrics(loss)
        else:
            loss, grads, norm = self.clipped_grads_local(clip_norm, params, *batch)
            metrics = _metrics(loss) | {"grad_norm": norm}
        params, opt_state = dp.zero_update(
            optimizer, grads, opt_state, params, self.zero_dims, self.batch_axes[0],
            tiles=self.fsdp_tiles,
        )  # fmt: skip
        return params, opt_state, metrics

    def _zero_step(
        self, optimizer: optax.GradientTransformation, clip_norm: float | None
    ) -> Callable[..., Any]:
        body = functools.partial(self.zero_step_local, optimizer, clip_norm)
        metrics = P()  # every metric is the same on every device

        def step(params: PyTree, opt_state: Any, *batch: Array):
            state_specs = dp.opt_state_specs(optimizer, params, self.state_specs)
            in_specs = (self.specs, state_specs, *self.batch_specs)
            return self.shard_map(body, in_specs, (self.specs, state_specs, metrics))(
                params, opt_state, *batch
            )

        return jax.jit(step, donate_argnums=(0, 1))


CHOICES = {
    "zero": (1, 2, 3),
    "compute_dtype": (None, "float32", "bfloat16"),
    "grad_sync": GRAD_SYNC,
}


def _check_arguments(
    mesh: Mesh,
    axes: Axes,
    loss_local: LossLocal | None,
    pipeline: staged.Stages | None,
    aux: bool,
    accumulate: Any,
) -> None:
    """PlanError (one sentence) for ``ShardedModel`` arguments that contradict each other."""
    missing = [a for a in axes if a not in mesh.shape]
    if missing:
        raise PlanError(
            f"Axis {missing[0]!r} is not in the mesh (axes: {', '.join(mesh.axis_names)})."
        )
    if loss_local is None and pipeline is None:
        raise PlanError("Give loss_local (or a pipeline, whose stages compute the loss).")
    if pipeline is not None and aux != (pipeline.metrics is not None):
        raise PlanError("Under a pipeline, give aux=True exactly when its Stages have metrics.")
    if not isinstance(accumulate, int) or accumulate < 1 or (accumulate > 1 and pipeline):
        raise PlanError(f"accumulate must be a positive integer (1 under a pipeline, which "
                        f"has microbatches of its own), got {accumulate!r}.")  # fmt: skip


def _check_choices(**given: Any) -> None:
    """PlanError (one sentence) for a ``ShardedModel`` argument outside its ``CHOICES``."""
    for name, value in given.items():
        if value not in CHOICES[name]:
            raise PlanError(f"{name} must be one of {CHOICES[name]}, got {value!r}.")


def _metrics(loss: Any) -> dict[str, Array]:
    """The step's metrics from ``loss_and_grads_local``'s first output (a dict under aux)."""
    return dict(loss) if isinstance(loss, dict) else {"loss": loss}


def _warn_unsplit_batch(batch_specs: Sequence[P], batch_axes: Axes) -> None:
    """Warns (once per call site) for a batch input whose spec splits no batch axis: every
    replica along them would get the whole input and data parallelism be off, silently."""
    for i, spec in enumerate(batch_specs):
        if batch_axes and not set(spec_axes(spec)) & set(batch_axes):
            warnings.warn(
                f"batch_specs[{i}] = {spec} splits no batch axis ({', '.join(batch_axes)}): "
                f"every replica along it gets the whole input, so data parallelism is off for "
                f"it (split dim 0 over {batch_axes[0]!r}, e.g. P({batch_axes[0]!r})).",
                stacklevel=3,
            )
