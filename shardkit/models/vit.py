"""The sharded ViT: ``vit_ref``'s model on a ``data × stage × seq × model`` mesh, by hand in
shard_map.

It consumes exactly the params pytree of ``vit_ref.init`` and places it with specs derived from
``vit_ref.param_axes`` through one rules table (``RULES``); nothing here writes a
``PartitionSpec`` per weight.

Inside the single ``shard_map`` of a step, per device (scaling-book notation, X = model,
S = the token axes of the sp mode, B split over data):

  images[B_data, H, W, C] -> embed (whole sequence) -> x[B_data, T_S, D]   (slice own tokens)
  per block (lax.scan over stacked layers; FSDP all-gathers the layer's weights first):
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
from shardkit.mesh import Plan, PlanError, format_mesh, logical_specs, make_mesh
from shardkit.models import sharded
from shardkit.parallel import data as dp
from shardkit.parallel import pipeline as pl
from shardkit.parallel import schedules
from shardkit.parallel import sequence as sp
from shardkit.parallel.collectives import all_gather
from shardkit.parallel.tensor import attention_tp, mlp_tp
from vit_ref import model as ref

Params = dict[str, Any]
AttentionCore = Callable[[Array, Array, Array], Array]

# Logical axis -> mesh axis. "embed" goes to data only under FSDP (see ``rules``).
RULES: dict[str, str] = {"heads": "model", "mlp": "model"}
# The leaves used only after the token reduction (pooling): their gradients are whole.
TOKEN_FREE = ("head",)
# Under a pipeline: the leaves chunk 0's prologue uses, and the last chunk's epilogue.
EMBED_LEAVES = ("embedding", "cls", "pos_embedding")
HEAD_LEAVES = ("encoder_norm", "head")


def rules(plan: Plan) -> dict[str, str]:
    """The logical-to-mesh axis table of the params for ``plan``; axes of size 1 split nothing.

    ``embed`` goes to data under FSDP (ZeRO-3) only."""
    return _table(plan, plan.zero == 3)


def state_rules(plan: Plan) -> dict[str, str]:
    """The table of the optimizer state and the synced gradients: ``rules`` plus ``embed``
    over data from ZeRO-1 up (a leaf with no embed dim, a bias over mlp or classes, is kept
    whole: ``zero_replicated``)."""
    return _table(plan, plan.zero >= 1)


def _table(plan: Plan, embed_over_data: bool) -> dict[str, str]:
    table = {**RULES, "embed": "data"} if embed_over_data else dict(RULES)
    if plan.pp != "none":
        table["layers"] = "stage"
    return {name: axis for name, axis in table.items() if plan.size(axis) > 1}


# ----------------------------------------------------------------------------- validation


def check_plan(cfg: vit_ref.ViTConfig, plan: Plan, batch: int | None = None) -> None:
    """Raises PlanError (one sentence: dimension, axis, sizes) if ``plan`` cannot run ``cfg``."""
    data, seq, model = (plan.size(a) for a in ("data", "seq", "model"))
    checks = [
        (batch is not None and batch % data, f"batch={batch} is not divisible by data={data}"),
        (cfg.heads % model, f"heads={cfg.heads} is not divisible by model={model}"),
        (cfg.mlp_dim % model, f"mlp_dim={cfg.mlp_dim} is not divisible by model={model}"),
        (
            plan.zero and data == 1,
            f"--zero {plan.zero} splits over data, but the mesh has data=1",
        ),
        (
            plan.zero and cfg.dim % data,
            f"dim={cfg.dim} is not divisible by data={data} (ZeRO-{plan.zero} splits the embed "
            "axis over data)",
        ),
        (
            plan.zero == 2 and plan.pp != "none",
            f"--zero 2 cannot run under --pp {plan.pp}: the schedule sums each layer's "
            "gradients over the microbatches before they are whole, so they cannot be "
            "reduce-scattered as backward makes them; use --zero 1 (the same memory here) or 3",
        ),
        (
            plan.sp == "none" and seq > 1,
            f"sp='none' does not split tokens over seq, but the mesh has seq={seq}; "
            "use --sp megatron, ring, ulysses or usp",
        ),
        (
            plan.sp == "megatron" and model == 1,
            "sp='megatron' splits tokens over the model axis, but the mesh has model=1",
        ),
        (
            plan.sp in ("ring", "ulysses", "usp") and seq == 1,
            f"sp={plan.sp!r} splits tokens over the seq axis, but the mesh has seq=1",
        ),
        (
            plan.sp == "ulysses" and (cfg.heads // model) % seq,
            f"sp='ulysses' needs the heads per model shard ({cfg.heads}//{model}="
            f"{cfg.heads // model}) divisible by seq={seq}",
        ),
        (
            plan.ulysses is not None and plan.sp not in ("usp", "megatron"),
            f"--ulysses {plan.ulysses} only applies to sp='usp' or 'megatron', not sp={plan.sp!r}",
        ),
        (
            plan.ulysses is not None and plan.sp == "megatron" and seq == 1,
            f"--ulysses {plan.ulysses} with sp='megatron' splits the seq axis, but the mesh has "
            "seq=1",
        ),
    ]
    for failed, message in checks:
        if failed:
            raise PlanError(message + ".")
    if plan.sp in ("usp", "megatron") and seq > 1:
        ulysses_factor(cfg, plan)
    check_pipeline(cfg, plan, batch)


def check_pipeline(cfg: vit_ref.ViTConfig, plan: Plan, batch: int | None = None) -> None:
    """PlanError (one sentence) unless the stage axis, the schedule, the depth, the virtual
    stages and the microbatches fit each other."""
    stages, micro, virtual = plan.size("stage"), plan.microbatches, plan.virtual
    local = None if batch is None else batch // plan.size("data")
    none = plan.pp == "none"
    checks = [
        (
            none and stages > 1,
            f"The mesh has stage={stages} but no pipeline schedule; give --pp gpipe, 1f1b, "
            "interleaved or zb",
        ),
        (none and micro > 1, f"--microbatches {micro} only applies with a pipeline (--pp)"),
        (none and virtual > 1, f"--virtual {virtual} only applies with --pp interleaved"),
        (
            not none and stages == 1,
            f"--pp {plan.pp} needs a stage axis of size > 1 in --mesh (it has stage=1)",
        ),
        (
            not none and virtual > 1 and plan.pp != "interleaved",
            f"--virtual {virtual} only applies to --pp interleaved, not --pp {plan.pp}",
        ),
        (
            not none and cfg.depth % (stages * virtual),
            f"depth={cfg.depth} is not divisible by stage×virtual = {stages}×{virtual} "
            "(every chunk holds the same number of layers)",
        ),
        (
            not none and local is not None and local % micro,
            f"The data-local batch ({batch}//{plan.size('data')}={local}) is not divisible by "
            f"--microbatches {micro}",
        ),
    ]
    for failed, message in checks:
        if failed:
            raise PlanError(message + ".")
    seq = plan.size("seq")
    if not none and seq > 1 and ulysses_factor(cfg, plan) < seq:
        raise PlanError(
            f"--pp {plan.pp} cannot run a ring over seq (--sp {plan.sp}): the ring's ppermute "
            "would run inside a schedule branch that only some stages take, which XLA cannot "
            f"do; use --sp ulysses (or --ulysses {seq})."
        )
    if not none:
        schedules.build(plan.pp, stages, micro, virtual)  # M vs S, --virtual vs the schedule


def schedule(plan: Plan) -> schedules.Schedule:
    """The pipeline schedule of ``plan`` (stage > 1)."""
    return schedules.build(plan.pp, plan.size("stage"), plan.microbatches, plan.virtual)


def layer_order(cfg: vit_ref.ViTConfig, plan: Plan) -> np.ndarray:
    """order[p] = the vit_ref layer stored at position p of the stacked blocks.

    Split over S stages, position p = (s, v, j) (row-major over [S, V, depth/(S·V)]) is layer j
    of chunk v·S + s: each device's contiguous block holds its chunks s, s+S, ... in order. The
    identity unless V > 1.
    """
    stages, virtual = plan.size("stage"), plan.virtual
    per_chunk = cfg.depth // (stages * virtual)
    s, v, j = np.meshgrid(range(stages), range(virtual), range(per_chunk), indexing="ij")
    return ((v * stages + s) * per_chunk + j).reshape(-1)


def ulysses_factor(cfg: vit_ref.ViTConfig, plan: Plan) -> int:
    """The Ulysses degree u of the seq axis (the ring runs over the other seq/u).

    ``usp``: ``--ulysses`` or the largest u the local heads allow; ``ulysses``: the whole seq
    axis; ``megatron`` over seq: a ring (u = 1) unless ``--ulysses`` says otherwise; others 1.
    """
    seq, heads_local = plan.size("seq"), cfg.heads // plan.size("model")
    if plan.sp == "ulysses":
        return seq
    if plan.sp == "usp" or (plan.sp == "megatron" and plan.ulysses is not None):
        return sp.usp_factor(seq, heads_local, plan.ulysses)
    return 1


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
    """

    mesh: Mesh
    token_axes: tuple[str, ...]
    attention: str
    num_tokens: int
    padded_tokens: int

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
    mesh = make_mesh(plan.mesh, devices)
    seq = plan.size("seq")
    token_axes: tuple[str, ...] = ()
    attention = "local"
    if seq > 1:
        u = ulysses_factor(cfg, plan)
        # Degenerate factors are the pure modes; only a true hybrid needs the split mesh.
        attention = "ring" if u == 1 else "ulysses" if u == seq else "usp"
        if attention == "usp":
            mesh, token_axes = sp.usp_mesh(mesh, u), sp.USP_SEQ
        else:
            token_axes = ("seq",)
    if plan.sp == "megatron":  # tokens also split over model outside the TP regions (minor)
        token_axes = (*token_axes, "model")
    shards = math.prod(mesh.shape[a] for a in token_axes)
    padded = -(-cfg.num_tokens // shards) * shards
    return Layout(mesh, token_axes, attention, cfg.num_tokens, padded)


def tokens_split(plan: Plan) -> bool:
    """Whether ``plan`` splits the token dim (sequence parallelism, or Megatron-SP over model)."""
    return plan.size("seq") > 1 or (plan.sp == "megatron" and plan.size("model") > 1)


def param_axes(cfg: vit_ref.ViTConfig, plan: Plan) -> Params:
    """``vit_ref.param_axes``, except under FSDP (ZeRO-3) with tokens split, where the row
    leaves (``row_leaves``) stay whole instead of split over data: each token shard's gradient
    there is its own rows, gathered over the token axes; split over data, every row would be
    gathered and reduce-scattered over data too (2(n_d−1)/n_d·T·d·w where t rows carry
    anything). Their params are T·d + d floats."""
    axes = vit_ref.param_axes(cfg)
    if plan.zero != 3 or not tokens_split(plan):
        return axes
    whole = {
        name: tuple(None if a == "embed" else a for a in axes[name]) for name in row_leaves(cfg)
    }
    return {**axes, **whole}


def param_specs(cfg: vit_ref.ViTConfig, plan: Plan) -> Params:
    """PartitionSpecs of every param leaf, from ``param_axes`` and ``rules(plan)``."""
    return logical_specs(param_axes(cfg, plan), rules(plan))


def state_specs(cfg: vit_ref.ViTConfig, plan: Plan) -> Params:
    """PartitionSpecs of the optimizer state's param-shaped leaves (``state_rules(plan)``)."""
    return logical_specs(param_axes(cfg, plan), state_rules(plan))


def zero_replicated(cfg: vit_ref.ViTConfig, plan: Plan) -> str | None:
    """One sentence naming the leaves a ZeRO level keeps whole on every device (not an error:
    the right call), or None. ZeRO-1/2: those with no embed dim for data to split, with their
    optimizer state (small). FSDP with tokens split: the row leaves (``param_axes`` says why)."""
    shapes = jax.eval_shape(lambda: vit_ref.init(jax.random.key(0), cfg))
    sizes = {sharded.leaf_path(path): shape.size
             for path, shape in jax.tree_util.tree_leaves_with_path(shapes)}  # fmt: skip
    total = sum(sizes.values())
    if plan.zero in (1, 2):
        names = jax.tree.leaves(vit_ref.param_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))
        whole = [name for name, logical in zip(sizes, names, strict=True) if "embed" not in logical]
        why = (
            f"with their optimizer state{' and gradients' if plan.zero == 2 else ''}, as they "
            "have no embed dim for data to split"
        )
    elif plan.zero == 3 and tokens_split(plan):
        whole = [name for name in row_leaves(cfg) if name in sizes]
        why = (
            "as with tokens split each token shard's gradient is its own rows, gathered over the "
            "token axes, where a split over data would gather and reduce-scatter every row"
        )
    else:
        return None
    if not whole:
        return None
    kept = sum(sizes[name] for name in whole)
    return (
        f"ZeRO-{plan.zero} keeps {len(whole)} leaves whole on every device, {why}: "
        f"{', '.join(whole)} ({kept:,} of {total:,} params, {kept / total:.1%})."
    )


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


def _attention_core(lay: Layout, key_valid: Array | None) -> AttentionCore:
    """The attention run on local heads: q, k, v[B, T_S, H_X, K] -> o[B, T_S, H_X, K].

    ``key_valid`` is the local attention's mask (Megatron-SP: over all tokens, built locally).
    The sequence-parallel cores mask padding by position (``num_valid``): nothing is sent.
    """
    if lay.attention == "local":
        return lambda q, k, v: sp.attention_local(q, k, v, key_valid)[0]
    num_valid = lay.num_tokens if lay.padded else None
    cores: dict[str, Callable[..., tuple[Array, Array]]] = {
        "ring": functools.partial(sp.attention_ring, axis="seq"),
        "ulysses": functools.partial(sp.attention_ulysses, axis="seq"),
        "usp": functools.partial(
            sp.attention_usp, ulysses_axis=sp.SEQ_ULYSSES, ring_axis=sp.SEQ_RING
        ),
    }
    core = functools.partial(cores[lay.attention], num_valid=num_valid)
    return lambda q, k, v: core(q, k, v, None)[0]


def _block_local(
    x: Array, p: Params, key_valid: Array | None, cfg: vit_ref.ViTConfig, lay: Layout
) -> Array:
    """One pre-LN block on local tokens with heads / MLP hidden split over ``model``."""
    dtype = ref.compute_dtype(cfg)
    model = "model" if lay.mesh.shape["model"] > 1 else None
    token_dim = 1 if lay.megatron else None
    core = _attention_core(lay, key_valid)
    h = ref.layer_norm(x, p["ln1"])
    x = x + attention_tp(h, p["attn"], model, core, dtype, token_dim=token_dim).astype(x.dtype)
    h = ref.layer_norm(x, p["ln2"])
    return x + mlp_tp(h, p["mlp"], model, ref.gelu, dtype, token_dim=token_dim).astype(x.dtype)


def _encoder_local(
    x: Array,
    blocks: Params,
    cfg: vit_ref.ViTConfig,
    plan: Plan,
    lay: Layout,
    gather: bool = True,
    frags: Params | None = None,
) -> Array:
    """lax.scan over the stacked layers; FSDP gathers each layer's weights inside the body
    (``gather=False``: the blocks are whole already, as a pipeline chunk's are). ZeRO-2: the
    gradients go to ``frags`` (the blocks' slices), each layer's reduce-scattered in its own
    backward step."""
    if gather:
        dims = sharded.gather_dims(param_specs(cfg, plan)["blocks"], "data", drop_leading=1)
    else:
        dims = jax.tree.map(lambda _: None, blocks)
    key_valid = None  # sequence-parallel attention masks padding by position (num_valid)
    if lay.megatron and lay.attention == "local" and lay.padded:  # attends over all tokens
        key_valid = jnp.arange(lay.padded_tokens) < lay.num_tokens

    zero_dims = sharded.gather_dims(state_specs(cfg, plan)["blocks"], "data", drop_leading=1)

    def body(x: Array, layer: tuple[Params, Params | None]) -> tuple[Array, None]:
        p_layer, f_layer = layer
        p_layer = dp.fsdp_gather(p_layer, dims)
        if f_layer is not None:
            p_layer = dp.zero_attach(p_layer, f_layer, zero_dims)
        return _block_local(x, p_layer, key_valid, cfg, lay), None

    if plan.remat:
        body = jax.checkpoint(body)
    x, _ = jax.lax.scan(body, x, (blocks, frags))
    return x


def row_leaves(cfg: vit_ref.ViTConfig) -> tuple[str, ...]:
    """The leaves indexed by token position: the learned position embedding (patch rows) and
    with it the class token (row 0 under ``pool="tok"``). Split over token shards, their
    gradients are disjoint row slices, not partial sums (``ShardedViT.sync_grads_local``).
    A fixed sincos2d embedding leaves the class token alone: one row, all-reduced with the
    rest."""
    if cfg.posemb != "learn":
        return ()
    return ("cls", "pos_embedding") if cfg.pool == "tok" else ("pos_embedding",)


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
    outer = dp.fsdp_gather(outer, sharded.gather_dims({k: specs[k] for k in outer}, "data"))
    if frag_outer is not None:
        zero = state_specs(cfg, plan)
        dims = sharded.gather_dims({k: zero[k] for k in outer}, "data")
        outer = dp.zero_attach(outer, frag_outer, dims)
    x = _embed_local(outer, images, cfg, lay)
    x = _encoder_local(x, params["blocks"], cfg, plan, lay, frags=frags and frags["blocks"])
    return _head_local(outer, x, cfg, lay)


def _split_blocks(params: Params) -> Params:
    """The leaves outside the layer stack (embedding, norms, head)."""
    return {k: v for k, v in params.items() if k != "blocks"}


# ----------------------------------------------------------------------------- pipeline


def _microbatches(x: Array, micro: int) -> Array:
    """[b, ...] -> [M, b/M, ...]: microbatch m holds local examples m·b/M ... (m+1)·b/M − 1."""
    return x.reshape(micro, x.shape[0] // micro, *x.shape[1:])


def _chunks(blocks: Params, virtual: int) -> Params:
    """This device's layers [V·n, ...] (in ``layer_order``) as V chunks [V, n, ...]."""
    return jax.tree.map(lambda a: a.reshape(virtual, a.shape[0] // virtual, *a.shape[1:]), blocks)


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
            gather=False,  # one layer at a time, inside the scan
            zero=plan.zero or 3,  # no rule splits over data below ZeRO-1
        )

    def __repr__(self) -> str:
        pp = (
            ""
            if self.plan.pp == "none"
            else (
                f", pp={self.plan.pp!r}, microbatches={self.plan.microbatches}, "
                f"virtual={self.plan.virtual}"
            )
        )
        return (
            f"ShardedViT(mesh={format_mesh(self.plan.mesh)}, sp={self.plan.sp!r}, "
            f"zero={self.plan.zero}, remat={self.plan.remat}{pp})"
        )

    @property
    def pipelined(self) -> bool:
        return self.plan.pp != "none"

    def check_batch(self, batch: int) -> None:
        check_plan(self.cfg, self.plan, batch)

    def shard(self, params: Params) -> Params:
        """Places a copy of vit_ref's ``params`` on the mesh (blocks in ``layer_order``)."""
        return super().shard(_reorder(params, layer_order(self.cfg, self.plan)))

    def to_reference(self, tree: Params) -> Params:
        """A params-shaped tree of this model (params, gradients) in vit_ref's layer order.

        The identity unless the interleaved schedule stores the layers in ``layer_order``.
        """
        return _reorder(tree, np.argsort(layer_order(self.cfg, self.plan)))

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

    def sync_grads_local(self, grads: Params) -> Params:
        """``sync_grads``, except the token-indexed leaves (``row_leaves``) over the token
        axes: each shard's rows are its own, so an all-gather of the row slices is their whole
        sum, (n−1)/n·T'·d·w instead of an all-reduce's 2(n−1)/n·T·d·w. The slices are
        all-reduced over data first (where it applies), in the step-end bucket."""
        rows = row_leaves(self.cfg) if self.layout.token_axes else ()
        if not rows:
            return super().sync_grads_local(grads)
        token_axes = self.layout.token_axes
        rest = {k: v for k, v in grads.items() if k not in rows}
        axes = {k: self.sync_axes[k] for k in rest}
        own = tuple(a for a in self.sync_axes["pos_embedding"] if a not in token_axes)
        synced = dp.sync_grads({**rest, "rows": _own_rows(grads, self.cfg, self.layout)},
                               {**axes, "rows": own})  # fmt: skip
        # The token rows never overlap: gathering them sums them, and makes them invariant.
        whole = all_gather(synced.pop("rows"), token_axes, tiled=True, to="invarying")
        return {**synced, **_from_rows(whole, self.cfg, self.layout)}

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
        """The schedule's forward and backward on M microbatches of the local batch.

        Params are cast varying over their sync axes (as without a pipeline), FSDP-gathered
        once (this device's layers, the embedding and the head), run by
        ``pipeline.pipeline_grads``, and the gradients reduce-scattered by the gather's
        transpose and all-reduced by ``sync_grads``; the embedding's and the head's are summed
        over ``stage`` by the engine (only the first / last stage adds to them).
        """
        plan, micro = self.plan, self.plan.microbatches
        global_batch = images.shape[0] * self.mesh.shape["data"]
        embed_fn, stage_fn, head_fn = _pipeline_fns(self.cfg, plan, self.layout)

        def loss_fn(p: Params, y: Array, labels_m: Array) -> Array:
            ce = optax.softmax_cross_entropy_with_integer_labels(head_fn(p, y), labels_m)
            return ce.sum() / global_batch

        dims = self.gather_dims()
        whole, scatter = jax.vjp(lambda p: dp.fsdp_gather(p, dims), dp.vary(params, self.vary_axes))
        embed_p, head_p = _split_outer(whole)
        loss, d_chunks, d_embed, d_head = pl.pipeline_grads(
            schedule(plan),
            stage_fn,
            _chunks(whole["blocks"], plan.virtual),
            pl.Ends(embed_fn, embed_p, loss_fn, head_p),
            _microbatches(images, micro),
            _microbatches(labels, micro),
        )
        d_blocks = jax.tree.map(lambda g, w: g.reshape(w.shape), d_chunks, whole["blocks"])
        d_whole = {**d_embed, **d_head, "blocks": d_blocks}
        (grads,) = scatter(jax.tree.map(_typed_like, {k: d_whole[k] for k in whole}, whole))
        return self.total_loss(loss), self.finish_grads(grads)

    def _pipeline_logits_local(self, params: Params, images: Array) -> Array:
        """logits[B_data, O]: the schedule's forwards alone (``pipeline.pipeline_forward``)."""
        plan = self.plan
        embed_fn, stage_fn, head_fn = _pipeline_fns(self.cfg, plan, self.layout)
        whole = dp.fsdp_gather(params, self.gather_dims())
        embed_p, head_p = _split_outer(whole)
        logits = pl.pipeline_forward(
            schedule(plan),
            stage_fn,
            _chunks(whole["blocks"], plan.virtual),
            embed_fn,
            embed_p,
            head_fn,
            head_p,
            _microbatches(images, plan.microbatches),
        )
        return logits.reshape(images.shape[0], *logits.shape[2:])


def _reorder(tree: Params, order: np.ndarray) -> Params:
    """``tree`` with every stacked block leaf indexed by ``order`` along its layer dim."""
    if np.array_equal(order, np.arange(len(order))):
        return tree
    return {**tree, "blocks": jax.tree.map(lambda a: a[order], tree["blocks"])}


def _typed_like(g: Array, ref_: Array) -> Array:
    """A gradient cast to its primal's varying axes (the pipeline types it over more, e.g.
    ``stage`` for the embedding's after its sum over stage, or ``data``)."""
    extra = tuple(a for a in dp.varying_axes(ref_) if a not in dp.varying_axes(g))
    return jax.lax.pcast(g, extra, to="varying") if extra else g
