"""The sharded ViT: ``vit_ref``'s model on a ``data × stage × seq × model`` mesh, by hand in
shard_map.

It consumes exactly the params pytree of ``vit_ref.init`` and places it with specs derived from
``vit_ref.param_axes`` through one rules table (``plan.RULES``); nothing here writes a
``PartitionSpec`` per weight. Every decision about the plan is ``models.vit.plan``'s.

Inside the single ``shard_map`` of a step, per device (scaling-book notation, X = model,
S = the token axes of the sp mode, B split over data):

  images[B_data, H, W, C] -> embed (whole sequence) -> x[B_data, T_S, D]   (slice own tokens)
  per block (scanned or unrolled over the stacked layers; FSDP all-gathers its weights first):
    x + attention_tp(LN(x)) over X, its core over S (local / ring / Ulysses / USP)
    x + mlp_tp(LN(x)) over X
  LN -> pool: psum over S of the class token or of the valid tokens -> pooled[B_data, D]
  head -> logits[B_data, O] -> cross-entropy / global batch.

Gradient collectives, all visible: params are cast to varying over the axes their gradient is a
partial sum over (the model's ``sync_axes``), autodiff runs on those, and ``data.sync_grads``
all-reduces once per axis set. FSDP leaves come back reduce-scattered instead (the transpose of
their all-gather); under ZeRO-1 every embed-split leaf's gradient is reduce-scattered once
backward is done, under ZeRO-2 each layer's in that layer's backward step (``data.zero_attach``
in the scan body), and the update runs on this device's slice before the params are all-
gathered (``ShardedModel.zero_step_local``). TP reductions are Megatron's f/g (or all-
gather/reduce-scatter pairs for sp="megatron", whose residual stream holds T/(seq·model)
tokens: each TP region gathers the model shards back to the seq split T_seq, and attention runs
its ring / Ulysses / USP core over seq on those, exactly as the other sp modes do). The
optimizer update runs outside the shard_map on arrays already sharded like their params, so it
moves nothing.

Pipeline (``plan.pp``, stage > 1): the stacked layers are split over ``stage`` in S·V chunks of
depth/(S·V) layers (chunk c on device c mod S; ``layer_order`` stores them so, and
``to_reference`` maps any params-shaped tree back to vit_ref's order), and
``parallel.pipeline`` runs the schedule on M microbatches of the data-local batch: the
embedding is chunk 0's prologue, the final norm, pooling, head and cross-entropy the last
chunk's epilogue. Under FSDP each device gathers its own layers (and the embedding and head)
once per step, before the schedule, and reduce-scatters their gradients once after it (as
torchtitan does under a pipeline), instead of per microbatch.

Token layout: T is padded to a multiple of the token-shard count (a ViT has patches + 1
tokens); padded keys are masked in attention and excluded from pooling; ``gap`` divides by the
true token count.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

import vit_ref
from shardkit.mesh import Plan, format_mesh, make_mesh
from shardkit.models import sharded, staged
from shardkit.models.vit.blocks import block_halves, block_local
from shardkit.models.vit.plan import (
    EMBED_LEAVES,
    HEAD_LEAVES,
    TOKEN_FREE,
    TokenSplit,
    check_batch,
    check_plan,
    check_rows,
    layer_order,
    param_axes,
    param_specs,
    row_leaves,
    schedule,
    state_rules,
    state_specs,
    token_split,
)
from shardkit.parallel import data as dp
from shardkit.parallel import pipeline as pl
from shardkit.parallel import sequence as sp
from shardkit.parallel import tensor, vma
from shardkit.parallel.collectives import all_gather
from shardkit.parallel.tiles import Tiles, tiles_for
from vit_ref import model as ref

Params = dict[str, Any]
_is_axes = lambda a: isinstance(a, tuple)  # noqa: E731

# ----------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where things live for one (cfg, plan): the mesh and the token split.

    Attributes:
      mesh: the mesh the step runs on (for USP, ``sequence.usp_mesh``'s split of the seq axis).
      token_axes: mesh axes the tokens are split over, major first (may be empty); Megatron-SP
        adds ``model`` last: each TP region all-gathers it, so attention sees the seq split.
      attention: "local", "ring", "ulysses" or "usp": the core run on local heads.
      num_tokens: true token count t; padded_tokens: t rounded up to the shard count.
      split: the plan's token-split decision these are read from (``plan.token_split``).
      kernel: the plan's attention kernel ("auto", "jnp" or "pallas"; ``shardkit.kernels``).
      overlap: ``Plan.overlap``: Megatron-SP's regions as collective matmuls, FSDP's layers
        gathered one ahead, DP's layers synced one behind.
    """

    mesh: Mesh
    token_axes: tuple[str, ...]
    attention: str
    num_tokens: int
    padded_tokens: int
    split: TokenSplit
    kernel: str = "auto"
    overlap: bool | str = False

    @property
    def fsdp_tiles(self) -> Tiles | None:
        """FSDP's and ZeRO's buckets as the tiles the TPU compiler keeps, on a TPU mesh."""
        return tiles_for(self.mesh)

    @property
    def token_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.token_axes)

    @property
    def local_tokens(self) -> int:
        return self.padded_tokens // self.token_shards

    @property
    def padded(self) -> bool:
        return self.padded_tokens != self.num_tokens

    @property
    def megatron(self) -> bool:
        """Megatron-SP: tokens split over model outside the TP regions, gathered inside."""
        return "model" in self.token_axes


def make_layout(cfg: vit_ref.ViTConfig, plan: Plan, devices: Any = None) -> Layout:
    """The mesh and token split for ``plan`` (validated first)."""
    check_plan(cfg, plan)
    split = token_split(cfg, plan)
    mesh = make_mesh(plan.mesh, devices)
    if split.attention == "usp":
        mesh = sp.usp_mesh(mesh, split.ulysses)
    padded = split.padded_tokens(cfg.num_tokens)
    return Layout(
        mesh, split.token_axes, split.attention, cfg.num_tokens, padded, split, plan.kernel,
        plan.overlap,
    )  # fmt: skip


def layer_sync_axes(cfg: vit_ref.ViTConfig, plan: Plan, lay: Layout) -> Params | None:
    """Under ``overlap`` with plain DP's gradient sync (no FSDP or ZeRO): per block leaf, the
    axes (mesh order) its gradient is all-reduced over in the next layer's backward step
    (``dp.sync_in_backward``) instead of at the step's end; None otherwise. The axes are the
    ``ShardedModel``'s ``sync_axes`` of the leaf: data, and the token axes it is not split
    over."""
    if not plan.syncs_by_layer:
        return None
    specs = state_specs(cfg, plan)["blocks"]
    if plan.layers == "list":
        specs = specs[0]  # every layer's are the same
    axes = sharded.grad_sync_axes(specs, lay.mesh, ("data",), lay.token_axes)
    order = lay.mesh.axis_names
    in_order = lambda a: tuple(x for x in order if x in a)  # noqa: E731
    return jax.tree.map(in_order, axes, is_leaf=_is_axes)


# ----------------------------------------------------------------------------- per device


def _token_ids(lay: Layout) -> Array:
    """Global token index of each local token, [t_local] (varying over the token axes)."""
    ids = jnp.arange(lay.local_tokens)
    if not lay.token_axes:
        return ids
    return jax.lax.axis_index(lay.token_axes) * lay.local_tokens + ids


def _embed_local(p: Params, images: Array, cfg: vit_ref.ViTConfig, lay: Layout) -> Array:
    """x[B_data, T_S, D]: the reference embedding of the whole sequence, own tokens kept.

    Embedding every token everywhere costs one small matmul and keeps the class token and
    position embedding exactly the reference's; the blocks, where the work is, see T/S tokens.
    """
    x = ref.embed(p, images, cfg)
    if not lay.token_axes:
        return x
    x = jnp.pad(x, ((0, 0), (0, lay.padded_tokens - lay.num_tokens), (0, 0)))
    start = jax.lax.axis_index(lay.token_axes) * lay.local_tokens
    return jax.lax.dynamic_slice_in_dim(x, start, lay.local_tokens, axis=1)


def _encoder_local(
    x: Array,
    blocks: Params,
    cfg: vit_ref.ViTConfig,
    plan: Plan,
    lay: Layout,
    gather: bool = True,
    frags: Params | None = None,
) -> Array:
    """The stacked layers, scanned or unrolled (``plan.layers``); FSDP gathers each layer's
    weights inside the body, or with ``overlap`` one layer ahead (``dp.prefetch_layers``)
    (``gather=False``: the blocks are whole already, as a pipeline chunk's are); DP with
    ``overlap`` syncs each layer's gradients in the next one's backward step
    (``layer_sync_axes``). ZeRO-2: the gradients go to ``frags`` (the blocks' slices), each
    layer's reduce-scattered in its own backward step, or with ``overlap`` as permutes in the
    previous layer's (``dp.zero_attach(permuted=True)`` one layer ahead). Plain TP with
    ``overlap``: the blocks run on two half-batches (``block_halves``,
    ``tensor.run_halves``)."""
    if gather:
        dims = _layer_dims(param_specs(cfg, plan)["blocks"], plan)
    else:
        dims = jax.tree.map(lambda _: None, ref.layer(blocks, 0))
    key_valid = None  # sequence-parallel attention masks padding by position (num_valid)
    if lay.megatron and lay.attention == "local" and lay.padded:  # attends over all tokens
        key_valid = jnp.arange(lay.padded_tokens) < lay.num_tokens

    zero_dims = _layer_dims(state_specs(cfg, plan)["blocks"], plan)

    @vma.checked_block
    def block(x: Array, p_layer: Params) -> Array:
        return block_local(x, p_layer, key_valid, cfg, lay)

    if plan.halves:
        block = functools.partial(block_halves, cfg=cfg, lay=lay)  # type: ignore[assignment]
    stack: Any = (blocks, frags)  # per layer: (params, ZeRO-2 fragments or None)
    if plan.layers == "list":
        stack = list(zip(blocks, frags or [None] * len(blocks), strict=True))
    fetch = _prefetch(cfg, plan, lay, dims if gather else None, zero_dims, frags is not None)
    if fetch is not None:
        run = lambda x, s: dp.prefetch_layers(block, fetch, x, s, plan.layers)  # noqa: E731
        one = lambda x, layer: block(x, fetch(layer))  # noqa: E731
        listed = blocks if frags is None else stack
    else:

        def one(x: Array, layer: tuple[Params, Params | None]) -> Array:
            p_layer, f_layer = layer
            p_layer = dp.fsdp_gather(p_layer, dims, tiles=lay.fsdp_tiles)
            if f_layer is not None:
                p_layer = dp.zero_attach(p_layer, f_layer, zero_dims, tiles=lay.fsdp_tiles)
            return block(x, p_layer)

        body = ref.remat_block(one, plan.remat)
        run = lambda x, s: ref.run_layers(body, x, s, plan.layers)[0]  # noqa: E731
        listed = stack
    if plan.halves:
        return tensor.run_halves(x, one, run, listed, scanned=plan.layers == "scan")
    return run(x, listed)


def _prefetch(
    cfg: vit_ref.ViTConfig,
    plan: Plan,
    lay: Layout,
    dims: Params | None,
    zero_dims: Params,
    zero2: bool,
) -> Callable[[Any], Params] | None:
    """``overlap``'s fetch for ``dp.prefetch_layers``: the plan's per-layer collective issued
    one layer ahead, its transpose one layer behind, as permutes. FSDP (``dims``, the gather
    dims; None: the blocks are whole): the gather, its reduce-scatter back; ZeRO-2 (the fetch
    takes (params, fragments)): a hook whose backward reduce-scatters; plain DP: a cast whose
    backward all-reduces (``layer_sync_axes``). None without ``overlap`` or any of them."""
    if not lay.overlap:
        return None
    if plan.fsdp and dims is not None:
        return lambda p: dp.fsdp_gather(p, dims, tiles=lay.fsdp_tiles, permuted_back=True)
    if zero2:
        return lambda pf: dp.zero_attach(
            pf[0], pf[1], zero_dims, tiles=lay.fsdp_tiles, permuted=True
        )
    sync_axes = layer_sync_axes(cfg, plan, lay)
    if sync_axes is None:
        return None
    return functools.partial(dp.sync_in_backward, axes_tree=sync_axes, dtype=plan.grad_sync)


def _layer_dims(block_specs: Any, plan: Plan) -> Params:
    """FSDP's or ZeRO's gather dim of each of one layer's leaves, from the blocks' specs
    (stacked: the layer dim dropped; ``layers="list"``: the first layer's)."""
    if plan.layers == "list":
        return sharded.gather_dims(block_specs[0], "data")
    return sharded.gather_dims(block_specs, "data", drop_leading=1)


def _own_rows(grads: Params, cfg: vit_ref.ViTConfig, lay: Layout) -> Array:
    """rows[t_S, D]: this token shard's rows of the token-indexed gradient (class token, then
    one row per patch, padded to T'); every other row of ``grads`` is zero here."""
    rows = grads["pos_embedding"][0]
    if cfg.pool == "tok":
        rows = jnp.concatenate([grads["cls"][0], rows], axis=0)
    rows = jnp.pad(rows, ((0, lay.padded_tokens - lay.num_tokens), (0, 0)))
    start = jax.lax.axis_index(lay.token_axes) * lay.local_tokens
    return jax.lax.dynamic_slice_in_dim(rows, start, lay.local_tokens, axis=0)


def _from_rows(rows: Array, cfg: vit_ref.ViTConfig, lay: Layout) -> Params:
    """{cls, pos_embedding} gradients from the gathered rows[T', D]."""
    rows = rows[None, : lay.num_tokens]
    if cfg.pool == "tok":
        return {"cls": rows[:, :1], "pos_embedding": rows[:, 1:]}
    return {"pos_embedding": rows}


def _pool_local(x: Array, cfg: vit_ref.ViTConfig, lay: Layout) -> Array:
    """pooled[B, D]: the class token or the mean of the valid tokens, summed over token shards."""
    if not lay.token_axes:
        return ref.pool(x, cfg)
    ids = _token_ids(lay)
    keep = ids == 0 if cfg.pool == "tok" else ids < lay.num_tokens
    partial = jnp.where(keep[None, :, None], x, 0.0).sum(axis=1)
    # Bring the class token (or the token sum) from the shards that hold it to every device.
    pooled = jax.lax.psum(partial, lay.token_axes)
    return pooled if cfg.pool == "tok" else pooled / lay.num_tokens


def _head_local(p: Params, x: Array, cfg: vit_ref.ViTConfig, lay: Layout) -> Array:
    """logits[B, O] from the last block's output: final norm, pooling over token shards, head."""
    pooled = _pool_local(ref.layer_norm(x, p["encoder_norm"]), cfg, lay)
    logits = ref.dense(pooled, p["head"], "bd,do->bo", ref.compute_dtype(cfg))
    return logits.astype(jnp.float32)


def _logits_local(
    params: Params,
    images: Array,
    cfg: vit_ref.ViTConfig,
    plan: Plan,
    lay: Layout,
    frags: Params | None = None,
) -> Array:
    """logits[B_data, O] from local params (FSDP fragments gathered here) and local images;
    ZeRO-2 (``frags``, the params' slices): their gradients go to ``frags``."""
    outer = _split_blocks(params)
    frag_outer = None if frags is None else _split_blocks(frags)
    specs = param_specs(cfg, plan)
    dims = sharded.gather_dims({k: specs[k] for k in outer}, "data")
    outer = dp.fsdp_gather(outer, dims, tiles=lay.fsdp_tiles)
    if frag_outer is not None:
        zero = state_specs(cfg, plan)
        dims = sharded.gather_dims({k: zero[k] for k in outer}, "data")
        outer = dp.zero_attach(outer, frag_outer, dims, tiles=lay.fsdp_tiles)
    x = _embed_local(outer, images, cfg, lay)
    x = _encoder_local(x, params["blocks"], cfg, plan, lay, frags=frags and frags["blocks"])
    return _head_local(outer, x, cfg, lay)


def _split_blocks(params: Params) -> Params:
    """The leaves outside the layer stack (embedding, norms, head)."""
    return {k: v for k, v in params.items() if k != "blocks"}


# ----------------------------------------------------------------------------- pipeline


def _pipeline_fns(cfg: vit_ref.ViTConfig, plan: Plan, lay: Layout) -> tuple[Callable, ...]:
    """(embed_fn, stage_fn, head_fn) of the ViT cut into pipeline chunks (params whole)."""

    def stage_fn(chunk: Params, x: Array) -> Array:
        return _encoder_local(x, chunk, cfg, plan, lay, gather=False)

    def embed_fn(p: Params, images: Array) -> Array:
        return _embed_local(p, images, cfg, lay)

    def head_fn(p: Params, y: Array) -> Array:
        return _head_local(p, y, cfg, lay)

    return embed_fn, stage_fn, head_fn


def _split_outer(params: Params) -> tuple[Params, Params]:
    """(the embedding's leaves, the head's leaves) of a params tree."""
    embed = {k: params[k] for k in EMBED_LEAVES if k in params}
    return embed, {k: params[k] for k in HEAD_LEAVES}


# ----------------------------------------------------------------------------- public


class ShardedViT(sharded.ShardedModel):
    """``vit_ref``'s ViT run by hand on a mesh: place params, forward, gradients, train step.

    ``model = ShardedViT(cfg, plan)``; ``params = model.shard(vit_ref.init(key, cfg))``;
    ``model.forward(params, images)``; ``model.loss_and_grads(params, images, labels)``;
    ``model.train_step(optimizer)`` returns a jitted step with params and optimizer state
    donated. Compiled functions are built once per instance and shared.

    A ``sharded.ShardedModel`` like any user's: vit_ref's logical axes, ``rules(plan)``, the
    layout's token axes, the head token-free (it sees pooled features), and a per-device
    cross-entropy over the global batch; the ViT adds the plan checks and ``forward``.
    """

    def __init__(self, cfg: vit_ref.ViTConfig, plan: Plan, devices: Any = None) -> None:
        self.cfg, self.plan = cfg, plan
        self.layout = make_layout(cfg, plan, devices)
        # Size-1 axes split nothing and appear in no spec (so no value is typed varying on them).
        self.batch_spec = P("data") if plan.size("data") > 1 else P()
        super().__init__(
            self.layout.mesh,
            param_axes(cfg, plan),
            state_rules(plan),
            self._loss_local,
            batch_specs=(self.batch_spec, self.batch_spec),
            token_axes=self.layout.token_axes,
            token_free=TOKEN_FREE,
            gather=False,  # one layer at a time, inside the layer loop
            zero=plan.zero or 3,  # no rule splits over data below ZeRO-1
            grad_sync=plan.grad_sync,
            accumulate=plan.microbatches if plan.pp == "none" else 1,
        )
        if layer_sync_axes(cfg, plan, self.layout) is not None:  # synced layer by layer instead
            done = jax.tree.map(lambda _: (), self.sync_axes["blocks"], is_leaf=_is_axes)
            self.sync_axes = {**self.sync_axes, "blocks": done}

    def __repr__(self) -> str:
        pp = "" if self.plan.microbatches == 1 else f", microbatches={self.plan.microbatches}"
        if self.plan.pp != "none":
            pp = f", pp={self.plan.pp!r}{pp}, virtual={self.plan.virtual}"
        kernel = "" if self.plan.kernel == "auto" else f", kernel={self.plan.kernel}"
        overlap = self.plan.overlap
        kernel += "" if not overlap else ", overlap" if overlap is True else f", overlap={overlap}"
        kernel += ", grad_sync=bfloat16" if self.plan.grad_sync == "bfloat16" else ""
        return (
            f"ShardedViT(mesh={format_mesh(self.plan.mesh)}, sp={self.plan.sp!r}, "
            f"zero={self.plan.zero}, remat={self.plan.remat}, layers={self.plan.layers}{pp}"
            f"{kernel})"
        )

    @property
    def pipelined(self) -> bool:
        return self.plan.pp != "none"

    def check_batch(self, batch: int) -> None:
        """PlanError unless the global ``batch`` fits the plan (the rest was checked once, when
        the model was built)."""
        check_batch(self.plan, batch)
        check_rows(self.cfg, self.plan, batch)

    def shard(self, params: Params) -> Params:
        """Places a copy of vit_ref's ``params`` on the mesh (blocks in ``layer_order``, or
        as a list of per-layer trees under ``layers="list"``; either form is taken)."""
        ordered = _reorder(ref.as_layers(params, "scan"), layer_order(self.cfg, self.plan))
        return super().shard(ref.as_layers(ordered, self.plan.layers))

    def to_reference(self, tree: Params) -> Params:
        """A params-shaped tree of this model (params, gradients) in vit_ref's layer order.

        The identity unless the interleaved schedule stores the layers in ``layer_order``, or
        ``layers="list"`` keeps them as a list (stacked back here).
        """
        stacked = ref.as_layers(tree, "scan")
        return _reorder(stacked, np.argsort(layer_order(self.cfg, self.plan)))

    def shard_batch(self, *arrays: Array) -> tuple[Array, ...]:
        """Splits arrays along their first (batch) dim over ``data``: the images alone (for
        ``forward``) or images and labels."""
        self.check_batch(arrays[0].shape[0])
        return tuple(jax.device_put(a, self.sharding(self.batch_spec)) for a in arrays)

    @functools.cached_property
    def forward(self) -> Callable[[Params, Array], Array]:
        """Jitted ``(params, images[B, H, W, C]) -> logits[B, O]`` (batch split over data)."""

        def body(params: Params, images: Array) -> Array:
            if self.pipelined:
                return self._pipeline_logits_local(params, images)
            return _logits_local(params, images, self.cfg, self.plan, self.layout)

        return jax.jit(self.shard_map(body, (self.specs, self.batch_spec), self.batch_spec))

    def _loss_local(
        self, params: Params, images: Array, labels: Array, frags: Params | None = None
    ) -> Array:
        """This device's share of the mean cross-entropy: its images' sum / the global batch."""
        global_batch = images.shape[0] * self.mesh.shape["data"]
        logits = _logits_local(params, images, self.cfg, self.plan, self.layout, frags)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return ce.sum() / global_batch

    def zero2_loss_local(self, frags: Params, params: Params, *batch: Array) -> Array:
        """ZeRO-2: each layer's gradients reduce-scattered in its own backward step."""
        images, labels = batch
        return self._loss_local(params, images, labels, frags=frags)

    def sync_grads_local(self, grads: Params, share: Array | None = None) -> tuple[Params, Any]:
        """``sync_grads``, except the token-indexed leaves (``row_leaves``) over the token
        axes: each shard's rows are its own, so an all-gather of the row slices is their whole
        sum, (n−1)/n·T'·d·w instead of an all-reduce's 2(n−1)/n·T·d·w. The slices are
        all-reduced over data first (where it applies), in the step-end bucket; the loss
        ``share`` rides there too (``riding``)."""
        rows = row_leaves(self.cfg) if self.layout.token_axes else ()
        if not rows:
            return super().sync_grads_local(grads, share)
        token_axes = self.layout.token_axes
        rest = {k: v for k, v in grads.items() if k not in rows}
        axes = {k: self.sync_axes[k] for k in rest}
        own = tuple(a for a in self.sync_axes["pos_embedding"] if a not in token_axes)
        rest = {**rest, "rows": _own_rows(grads, self.cfg, self.layout)}
        inner, loss = self.riding(rest, {**axes, "rows": own}, share)
        # The token rows never overlap: gathering them sums them, and makes them invariant.
        whole = all_gather(inner.pop("rows"), token_axes, tiled=True, to="invarying")
        return {**inner, **_from_rows(whole, self.cfg, self.layout)}, loss

    # ------------------------------------------------------------------------- pipeline

    def loss_and_grads_local(self, params: Params, *batch: Array) -> tuple[Array, Params]:
        """Inside shard_map: (global loss, synced gradients sharded like params); batch is
        (images, labels)."""
        if not self.pipelined:
            return super().loss_and_grads_local(params, *batch)
        return self._pipeline_grads_local(params, *batch)

    def _pipeline_grads_local(
        self, params: Params, images: Array, labels: Array
    ) -> tuple[Array, Params]:
        """The schedule's forward and backward on M microbatches of the local batch, through
        the generic pipeline option (``models.staged``): the embedding is chunk 0's
        prologue, the final norm, pooling, head and cross-entropy the last chunk's epilogue."""
        global_batch = images.shape[0] * self.mesh.shape["data"]
        embed_fn, stage_fn, head_fn = _pipeline_fns(self.cfg, self.plan, self.layout)

        def loss_fn(p: Params, y: Array, labels_m: Array) -> Array:
            ce = optax.softmax_cross_entropy_with_integer_labels(head_fn(p, y), labels_m)
            return ce.sum() / global_batch

        embed = tuple(k for k in EMBED_LEAVES if k in params)
        stages = staged.Stages(schedule(self.cfg, self.plan), embed_fn, stage_fn, loss_fn, "blocks",
                               embed, HEAD_LEAVES)  # fmt: skip
        return staged.grads_local(self, stages, params, images, labels)

    def _pipeline_logits_local(self, params: Params, images: Array) -> Array:
        """logits[B_data, O]: the schedule's forwards alone (``pipeline.pipeline_forward``)."""
        plan = self.plan
        embed_fn, stage_fn, head_fn = _pipeline_fns(self.cfg, plan, self.layout)
        whole = dp.fsdp_gather(params, self.gather_dims(), tiles=self.fsdp_tiles)
        embed_p, head_p = _split_outer(whole)
        logits = pl.pipeline_forward(
            schedule(self.cfg, plan),
            stage_fn,
            staged.chunks(whole["blocks"], plan.virtual),
            embed_fn,
            embed_p,
            head_fn,
            head_p,
            staged.microbatches(images, plan.microbatches),
        )
        return logits.reshape(images.shape[0], *logits.shape[2:])


def _reorder(tree: Params, order: np.ndarray) -> Params:
    """``tree`` with every stacked block leaf indexed by ``order`` along its layer dim."""
    if np.array_equal(order, np.arange(len(order))):
        return tree
    return {**tree, "blocks": jax.tree.map(lambda a: a[order], tree["blocks"])}
