"""A causal character-level decoder, Llama style, with dense or mixture-of-experts blocks, on
``data × expert × seq × model``, built only from shardkit primitives on ``ShardedModel``.

RMSNorm, rotary embeddings at each token's global position, grouped-query attention
(``tensor.attention_tp`` around a causal ring or Ulysses core over ``seq``; KV weights whole
and ``kv_repeat`` when ``model`` outnumbers the KV heads), a SwiGLU MLP over ``model`` — or,
with ``GPTConfig.experts``, E SwiGLU experts behind a top-k router (``moe.moe_layer``, experts
over ``expert``, which splits the batch too), the load-balance and z-losses added to the loss
— no biases, and the vocabulary split over ``model`` in the embedding and the head (the
logits are never gathered); the head is its own matrix, or with ``GPTConfig.tied`` the
embedding's transpose. The data: windows of the Zen of Python (``this.s``).

  batch    x, y[B_data×expert, T_seq] token ids, in ``plan.layout`` order over seq
  params   embed[V_model, D], blocks (stacked over layers), norm[D], head[D, V_model] (none
           when tied); FSDP (``plan.fsdp``): every embed dim over data too

The twin (``twin_loss``) is the same decoder in plain jnp, its MoE blocks ``moe_ref``'s,
routing the sharded run's groups in their layout order so that drops agree.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import functools
import io
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import moe_ref
from shardkit.mesh import AXES, KERNELS, PlanError, format_mesh
from shardkit.models import staged
from shardkit.models.sharded import ShardedModel
from shardkit.parallel import lm, moe, remat, sequence, tensor
from shardkit.parallel.pipeline import schedules
from shardkit.parallel.sequence import layouts

with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
    import this
TEXT = codecs.decode(this.s, "rot13")
CHARS = sorted(set(TEXT))
VOCAB = -(-len(CHARS) // 8) * 8  # padded so it splits over up to 8 model devices
ALPHA, BETA = 1e-2, 1e-3  # the load-balance and router z-loss weights
CORES = ("ring", "ulysses")
Params = Any


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The decoder's dims; ``experts`` (a ``moe.MoE``) makes every block's MLP a MoE whose
    experts each have ``mlp`` hidden units; ``documents``: packed documents (each line of the
    text one; a token attends only to its own line, positions restart at every line, a line's
    last token predicts nothing), the batch (x, y, segment ids, positions); ``tied``: the head
    is the embedding's transpose (no ``head`` leaf; the embedding's gradient sums both uses)."""

    dim: int = 64
    heads: int = 8
    kv_heads: int = 2
    mlp: int = 128
    layers: int = 2
    tokens: int = 64
    vocab: int = VOCAB
    experts: moe.MoE | None = None
    documents: bool = False
    tied: bool = False


def moe_config(experts: moe.MoE, **dims: Any) -> GPTConfig:
    """The MoE decoder: the dense one's dims (and ``documents``), each expert half the dense
    MLP."""
    return GPTConfig(**{"mlp": 64, **dims}, experts=experts)


@dataclasses.dataclass(frozen=True)
class GPTPlan:
    """How the decoder is split: the mesh, the token layout over seq, the attention core over
    seq (``"ring"`` or ``"ulysses"``), FSDP over data, what the blocks' backward recomputes
    (``remat``: a ``parallel.remat`` policy), attention's kernel (``mesh.KERNELS``), and the
    pipeline over ``stage`` (``pp``: a ``schedules.SCHEDULES`` name, M ``microbatches`` of the
    data-local batch, ``virtual`` chunks per stage)."""

    mesh: dict[str, int]
    layout: str = "contiguous"
    core: str = "ring"
    fsdp: bool = False
    remat: str = "none"
    kernel: str = "auto"
    pp: str = "none"
    microbatches: int = 1
    virtual: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh", {**dict.fromkeys(AXES, 1), **self.mesh})
        if self.pp == "zbv" and self.virtual == 1:  # ZBV's V: two chunks per stage
            object.__setattr__(self, "virtual", 2)

    @property
    def name(self) -> str:
        extra = (
            (f", {self.core} {self.layout}" if self.mesh["seq"] > 1 else "")
            + (", FSDP" if self.fsdp else "")
            + (f", remat {self.remat}" if self.remat != "none" else "")
            + (f", {self.kernel} kernel" if self.kernel != "auto" else "")
            + (f", {self.pp} M={self.microbatches}" if self.pp != "none" else "")
            + (f" V={self.virtual}" if self.virtual > 1 else "")
        )
        return format_mesh(self.mesh) + extra

    def schedule(self) -> schedules.Schedule:
        """The pipeline schedule (``pp`` not "none"), in the form the engine runs it: uniform
        (``schedules.uniform``) when a ring over seq puts a ppermute inside every chunk, else
        phased (``schedules.phased``: GPipe as built)."""
        built = schedules.build(self.pp, self.mesh["stage"], self.microbatches, self.virtual)
        ring = self.core == "ring" and self.mesh["seq"] > 1
        return schedules.uniform(built) if ring else schedules.phased(built)


def check_plan(cfg: GPTConfig, plan: GPTPlan, batch: int) -> None:
    """PlanError (one sentence: dim, axis, sizes) if ``plan`` cannot run ``cfg`` at ``batch``."""
    data, _, ep, seq, model = (plan.mesh[a] for a in AXES)
    experts = cfg.experts.experts if cfg.experts else 0
    local_heads = cfg.heads // model if cfg.heads % model == 0 else 0
    checks = [
        (min(cfg.dim, cfg.heads, cfg.kv_heads, cfg.mlp, cfg.layers) < 1,
         "dim, heads, KV heads, mlp and layers must be positive integers"),
        (cfg.dim % max(cfg.heads, 1) or cfg.dim // max(cfg.heads, 1) % 2,
         f"dim={cfg.dim} does not split into heads={cfg.heads} of an even size (RoPE)"),
        (cfg.heads % max(cfg.kv_heads, 1),
         f"heads={cfg.heads} is not divisible by the KV heads ({cfg.kv_heads})"),
        *_pipeline_checks(cfg, plan, batch),
        (plan.core not in CORES, f"The core must be one of {CORES}, got {plan.core!r}"),
        (plan.kernel not in KERNELS,
         f"The kernel must be one of {', '.join(KERNELS)}, got {plan.kernel!r}"),
        (plan.remat not in remat.POLICIES,
         f"remat must be one of {', '.join(remat.POLICIES)}, got {plan.remat!r}"),
        (ep > 1 and not experts, f"The mesh has expert={ep} but the GPT has no experts"),
        (experts % ep, f"experts={experts} is not divisible by expert={ep}"),
        (cfg.heads % model, f"heads={cfg.heads} is not divisible by model={model}"),
        (cfg.mlp % model, f"mlp={cfg.mlp} is not divisible by model={model}"),
        (cfg.vocab % model, f"The vocabulary ({cfg.vocab}) is not divisible by model={model}"),
        (batch % (data * ep), f"batch={batch} is not divisible by data×expert={data * ep}"),
        (plan.fsdp and cfg.dim % data, f"dim={cfg.dim} is not divisible by data={data} (FSDP)"),
        (plan.core == "ulysses" and local_heads % seq,
         f"Ulysses needs the heads per model shard ({local_heads}) divisible by seq={seq}"),
        (cfg.tokens % layouts.multiple(plan.layout, seq),
         f"tokens={cfg.tokens} do not split over seq={seq} in the {plan.layout} layout"),
    ]  # fmt: skip
    for failed, message in checks:
        if failed:
            raise PlanError(message + ".")
    if plan.pp != "none":
        try:
            plan.schedule()
        except ValueError as err:
            raise PlanError(str(err)) from None


def _pipeline_checks(cfg: GPTConfig, plan: GPTPlan, batch: int) -> list[tuple[Any, str]]:
    """(failed, message) pairs for the pipeline: a dense decoder of two batch inputs, layers
    and the local batch that split."""
    stage, chunks = plan.mesh["stage"], plan.mesh["stage"] * max(plan.virtual, 1)
    local = batch // max(plan.mesh["data"] * plan.mesh["expert"], 1)
    if plan.pp == "none":
        return [(stage > 1, f"The mesh has stage={stage}; give --pp (gpipe, 1f1b, ...)"),
                (plan.microbatches > 1 or plan.virtual > 1,
                 "--microbatches and --virtual need a pipeline (--pp)")]  # fmt: skip
    return [
        (plan.pp not in schedules.SCHEDULES,
         f"--pp must be one of {', '.join(schedules.SCHEDULES)}, got {plan.pp!r}"),
        (min(plan.microbatches, plan.virtual) < 1,
         "--microbatches and --virtual must be positive integers"),
        (stage == 1, f"--pp {plan.pp} needs a stage axis of size > 1 in --mesh (it has stage=1)"),
        (cfg.layers % chunks, f"layers={cfg.layers} do not split into stage×virtual={chunks} "
         "chunks"),
        (local % max(plan.microbatches, 1), f"The data-local batch ({local}) is not divisible by "
         f"--microbatches {plan.microbatches}"),
    ]  # fmt: skip


# --8<-- [start:axes]
def param_axes(experts: bool = False, tied: bool = False) -> dict[str, Any]:
    """Logical names per dim of every leaf (no biases); ``experts``: MoE blocks; ``tied``: no
    head (the embedding serves)."""
    w = lambda *names: {"kernel": names}  # noqa: E731
    mlp: dict[str, Any] = {"gate": w("embed", "mlp"), "up": w("embed", "mlp"),
                           "down": w("mlp", "embed")}  # fmt: skip
    if experts:  # E experts' SwiGLUs, stacked, and the router (replicated)
        mlp = {"router": ("embed", "router"), "gate": ("expert", "embed", "mlp"),
               "up": ("expert", "embed", "mlp"), "down": ("expert", "mlp", "embed")}  # fmt: skip
    block = {"norm1": ("embed",), "norm2": ("embed",), "mlp": mlp,
             "attn": {"query": w("embed", "heads", "head_dim"),
                      "key": w("embed", "kv_heads", "head_dim"),
                      "value": w("embed", "kv_heads", "head_dim"),
                      "out": w("heads", "head_dim", "embed")}}  # fmt: skip
    stacked = jax.tree.map(lambda n: ("layers", *n), block, is_leaf=lambda x: isinstance(x, tuple))
    axes = {"embed": ("vocab", "embed"), "head": ("embed", "vocab"), "blocks": stacked,
            "norm": ("embed",)}  # fmt: skip
    return {k: v for k, v in axes.items() if not (tied and k == "head")}


def rules(n_model: int, kv_heads: int, fsdp: bool, pipelined: bool = False) -> dict[str, str]:
    """Heads, MLP and vocabulary over model; KV heads too unless model outnumbers them
    (then they stay whole and ``kv_repeat`` picks each device's one); experts over expert;
    ``fsdp``: embed over data; ``pipelined``: the stacked layers over stage."""
    out = {"heads": "model", "mlp": "model", "vocab": "model", "expert": "expert"}
    if n_model <= kv_heads:
        out["kv_heads"] = "model"
    if pipelined:
        out["layers"] = "stage"
    return {**out, "embed": "data"} if fsdp else out


# --8<-- [end:axes]


def init(seed: int, cfg: GPTConfig) -> Params:
    """Random params: matrices N(0, 1/fan_in), norm scales near 1."""
    experts = cfg.experts.experts if cfg.experts else 0
    sizes = {"vocab": cfg.vocab, "embed": cfg.dim, "heads": cfg.heads, "mlp": cfg.mlp,
             "kv_heads": cfg.kv_heads, "head_dim": cfg.dim // cfg.heads, "layers": cfg.layers,
             "expert": experts, "router": experts}  # fmt: skip
    axes = param_axes(experts > 0, cfg.tied)
    names, tree = jax.tree.flatten(axes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(seed), len(names))

    def leaf(key: jax.Array, ns: tuple[str, ...]) -> jax.Array:
        dims = [n for n in ns if n not in ("layers", "expert")]  # the first is the fan-in
        noise = jax.random.normal(key, [sizes[n] for n in ns])
        return noise / np.sqrt(sizes[dims[0]]).item() if len(dims) > 1 else 1.0 + 0.1 * noise

    return jax.tree.unflatten(tree, [leaf(k, ns) for k, ns in zip(keys, names, strict=True)])


def windows(
    rng: np.random.Generator, batch: int, t: int, documents: bool = False
) -> tuple[jax.Array, ...]:
    """x[B, T] random windows of the text, y the next characters; ``documents``: also each
    token's line in the window (segment ids) and its position in that line (``lm.
    document_positions``, on the whole row), and y = ``lm.IGNORE`` where the next character
    starts another line."""
    ids = np.array([CHARS.index(c) for c in TEXT], np.int32)
    lines = np.cumsum([0] + [c == "\n" for c in TEXT], dtype=np.int32)  # line of each char
    starts = rng.integers(0, len(ids) - t - 1, batch)
    x = np.stack([ids[s : s + t] for s in starts])
    y = np.stack([ids[s + 1 : s + t + 1] for s in starts])
    if not documents:
        return jnp.asarray(x), jnp.asarray(y)
    seg = np.stack([lines[s : s + t] - lines[s] for s in starts])
    crossing = np.stack([lines[s + 1 : s + t + 1] - lines[s] for s in starts]) != seg
    y = np.where(crossing, lm.IGNORE, y)
    return tuple(jnp.asarray(a) for a in (x, y, seg, lm.document_positions(jnp.asarray(seg))))


# --8<-- [start:twin]
def twin_logits(
    p: Params,
    x: jax.Array,
    cfg: GPTConfig,
    plan: GPTPlan | None = None,
    *,
    seg: jax.Array | None = None,
    moe_block: Any = None,
    constrain: Any = None,
    unroll: bool = False,
):
    """The unsharded decoder in plain jnp: x[B, T] token ids -> (logits[B, T, V], aux losses
    summed over layers). MoE blocks route ``plan``'s groups (its devices' tokens, in its
    layout's order over seq); no plan: one group. ``seg[B, T]``: packed documents (attention
    within a segment, positions from its start).

    Hooks for XLA's partitioner (``run.lm_bench``): ``moe_block(z, m) -> (out, weighted aux
    loss)`` replaces ``moe_ref``'s blocks; ``constrain(h)`` pins the residual stream at the
    embedding and every block input (a GSPMD user's token sharding); ``unroll`` unrolls the
    layer scan (the partitioned scan deadlocked XLA:CPU's device threads, docs/design.md).
    """
    mask = jnp.tril(jnp.ones((1,) + (x.shape[1],) * 2, bool))  # [1 or B, T, T]
    pos: jax.Array = jnp.arange(x.shape[1])
    if seg is not None:  # packed documents: within a segment, positions from its start
        pos, mask = lm.document_positions(seg), mask & (seg[:, :, None] == seg[:, None, :])
    constrain = constrain or (lambda h: h)
    plan = plan or GPTPlan({})
    grouping = (plan.mesh["data"] * plan.mesh["expert"], plan.mesh["seq"])
    n_seq = plan.mesh["seq"]

    def experts(z: jax.Array, m: Params) -> tuple[jax.Array, jax.Array]:
        z = layouts.to_layout(z, n_seq, plan.layout)
        out, aux = moe_ref.layer(m, z, cfg.experts, grouping)
        loss = ALPHA * aux["load_balance"] + BETA * aux["router_z"]
        return layouts.from_layout(out, n_seq, plan.layout), loss

    def attention(h: jax.Array, a: Params) -> jax.Array:
        q, k, v = (jnp.einsum("btd,dhk->bthk", h, a[n]["kernel"]) for n in ("query", "key",
                                                                             "value"))  # fmt: skip
        q, k = lm.apply_rope(q, pos), lm.apply_rope(k, pos)
        k, v = (jnp.repeat(z, q.shape[2] // z.shape[2], axis=2) for z in (k, v))  # GQA
        s = jnp.einsum("bthk,bshk->bhts", q, k) / float(np.sqrt(q.shape[-1]))
        s = jnp.where(mask[:, None], s, -jnp.inf)
        return jnp.einsum("bhts,bshk,hkd->btd", jax.nn.softmax(s, axis=-1), v, a["out"]["kernel"])

    def block(h: jax.Array, b: Params) -> tuple[jax.Array, jax.Array]:
        h = constrain(h)
        h = h + attention(lm.rms_norm(h, b["norm1"]), b["attn"])
        z, m = lm.rms_norm(h, b["norm2"]), b["mlp"]
        if cfg.experts is not None:
            z, aux = (moe_block or experts)(z, m)
            return h + z, aux
        z = jax.nn.silu(z @ m["gate"]["kernel"]) * (z @ m["up"]["kernel"])
        return h + z @ m["down"]["kernel"], jnp.zeros(())

    h, aux = jax.lax.scan(block, constrain(p["embed"][x]), p["blocks"], unroll=unroll)
    return lm.rms_norm(h, p["norm"]) @ head_of(p, cfg), aux.sum()


def twin_loss(
    p: Params, x: jax.Array, y: jax.Array, cfg: GPTConfig, plan: GPTPlan | None = None, **hooks
):
    """Next-token cross-entropy averaged over the real targets (``lm.IGNORE`` ones left out)
    plus the MoE losses, unsharded (``hooks``: as ``twin_logits``). A pipelined MoE plan routes
    and balances each microbatch apart (``_microbatched``), as its stages do."""
    if plan is not None and plan.pp != "none" and cfg.experts is not None:
        logits, aux = _microbatched(p, x, cfg, plan, **hooks)
    else:
        logits, aux = twin_logits(p, x, cfg, plan, **hooks)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(y, 0))
    return jnp.where(y >= 0, ce, 0.0).sum() / jnp.sum(y >= 0, dtype=jnp.float32) + aux


# --8<-- [end:twin]


def _microbatched(p: Params, x: jax.Array, cfg: GPTConfig, plan: GPTPlan, **hooks: Any):
    """``twin_logits`` microbatch by microbatch: microbatch m is every data shard's m-th slice
    of its rows (``staged.microbatches``), routed in its own groups, its aux losses its own;
    the logits back in batch order, the aux losses their mean over the M microbatches."""
    shards, micro = plan.mesh["data"] * plan.mesh["expert"], plan.microbatches

    def split(a: jax.Array) -> jax.Array:  # [B, ...] -> [M, B/M, ...]
        a = a.reshape(shards, micro, -1, *a.shape[1:]).swapaxes(0, 1)
        return a.reshape(micro, -1, *a.shape[3:])

    seg = hooks.pop("seg", None)
    segs = [None] * micro if seg is None else list(split(seg))
    outs = [
        twin_logits(p, xm, cfg, plan, seg=sm, **hooks)
        for xm, sm in zip(split(x), segs, strict=True)
    ]
    logits = jnp.stack([o[0] for o in outs])  # [M, B/M, T, V]
    logits = logits.reshape(micro, shards, -1, *logits.shape[2:]).swapaxes(0, 1)
    return logits.reshape(x.shape[0], *logits.shape[3:]), sum(o[1] for o in outs) / micro


# --8<-- [start:sharded]
def sharded_gpt(mesh: Any, cfg: GPTConfig, plan: GPTPlan) -> ShardedModel:
    """The decoder on ``mesh`` as ``plan`` says (``check_plan`` first); with experts its step
    reports tokens per expert, dropped assignments and their fraction."""
    n_model, n_seq = mesh.shape["model"], mesh.shape["seq"]
    tp, sp = ("model" if n_model > 1 else None), ("seq" if n_seq > 1 else None)
    ep = "expert" if mesh.shape["expert"] > 1 else None
    attend = {"ring": sequence.attention_ring, "ulysses": sequence.attention_ulysses}[plan.core]

    def causal_core(seg):  # over seq on local heads; GQA K/V blocks stay h_kv-headed
        return lambda q, k, v: attend(q, k, v, causal=True, layout=plan.layout,
                                      segment_ids=seg, kernel=plan.kernel)[0]  # fmt: skip

    def mlp(z, m):  # SwiGLU over model, or the experts: (out, aux losses' share, counts)
        if cfg.experts is None:
            return tensor.gated_mlp_tp(z, m, tp), jnp.zeros(()), jnp.zeros(1)
        out, aux = moe.moe_layer(z, m, cfg.experts, expert_axis=ep, tp=tp,
                                 batch_axes=("data", "expert"), seq_axes=("seq",))  # fmt: skip
        counts = jnp.concatenate([aux.tokens_per_expert, aux.dropped[None]])
        return out, ALPHA * aux.load_balance + BETA * aux.router_z, counts

    def blocks(h, stacked, seg=None, pos=None):  # the layers: (h, per-layer aux and counts)
        if pos is None:  # GLOBAL positions; packed documents: from each one's start (data)
            pos = layouts.local_positions(plan.layout, sp, h.shape[1])
        rope, core = lm.rope(pos), causal_core(seg)

        @remat.block  # the plan's remat; a forgotten row-parallel reduction named at trace time
        def block(h, b):
            a = tensor.attention_tp(lm.rms_norm(h, b["norm1"]), b["attn"], tp, core,
                                    rope=rope, kv_repeat=n_model > cfg.kv_heads)  # fmt: skip
            h = h + a
            z, aux, counts = mlp(lm.rms_norm(h, b["norm2"]), b["mlp"])
            return h + z, (aux, counts)

        return jax.lax.scan(block, h, stacked)

    def ce_sum(p, h, y):  # this device's summed cross-entropy
        logits = lm.vocab_logits(lm.rms_norm(h, p["norm"]), head_of(p, cfg), tp)  # [b, t, V/n]
        return lm.vocab_cross_entropy(logits, y, tp).sum()

    def loss_local(p, x, y, seg=None, pos=None):  # this device's share (and the MoE metrics)
        h, (aux, counts) = blocks(lm.vocab_embed(x, p["embed"], tp), p["blocks"], seg, pos)
        share = ce_sum(p, h, y) / targets(y)
        if cfg.experts is None:
            return share
        return share + aux.sum(), _moe_metrics(cfg, mesh, counts.sum(0), y)

    def targets(y):  # the global count of real targets: every token's, or summed (documents)
        if not cfg.documents:
            return y.size * mesh.shape["data"] * mesh.shape["expert"] * n_seq
        return jax.lax.psum(lm.valid_count(y), tuple(a for a in token_split if mesh.shape[a] > 1))

    embed = lambda p, x: lm.vocab_embed(x, p["embed"], tp)  # noqa: E731
    pipeline = _stages(cfg, plan, mesh, (embed, blocks, ce_sum, targets))
    token_split, tokens = ("data", "expert", "seq"), P(("data", "expert"), "seq")
    return ShardedModel(mesh, param_axes(cfg.experts is not None, cfg.tied),
                        rules(n_model, cfg.kv_heads, plan.fsdp, pipeline is not None),
                        None if pipeline else loss_local,
                        batch_specs=(tokens,) * (4 if cfg.documents else 2),
                        token_axes=("expert", "seq"), aux=bool(cfg.experts),
                        remat=plan.remat, pipeline=pipeline)  # fmt: skip


# --8<-- [end:sharded]


def head_of(p: Params, cfg: GPTConfig) -> jax.Array:
    """The head [D, V] (per device: [D, V/model]): its own leaf, or the embedding's transpose."""
    return p["embed"].T if cfg.tied else p["head"]


def _stages(
    cfg: GPTConfig, plan: GPTPlan, mesh: Any, parts: tuple[Callable[..., Any], ...]
) -> staged.Stages | None:
    """The decoder cut for ``plan.pp`` from its ``parts`` (embed, blocks, the summed
    cross-entropy, the global count of real targets): the embedding on
    the first stage, the blocks as the chunks (packed documents: each microbatch's segment ids
    and positions their side inputs), the final norm, head and cross-entropy on the last,
    divided by the global count. Tied, the embedding is an end of both: its two gradients meet
    in the engine's all-reduce over stage (``staged.Stages``). MoE: each chunk's routing
    counts, summed by the engine over chunks and microbatches, give the step's metrics."""
    if plan.pp == "none":
        return None
    embed, blocks, ce_sum, targets = parts

    def chunk(c, h, side=()):  # MoE: (h, this microbatch's aux losses over M, its counts)
        h, (aux, counts) = blocks(h, c, *side)
        return h if cfg.experts is None else (h, aux.sum() / plan.microbatches, counts.sum(0))

    moe = cfg.experts is not None
    return staged.Stages(
        plan.schedule(), embed, chunk, ce_sum, "blocks", embed=("embed",),
        head=("norm", "embed" if cfg.tied else "head"), divisor=targets, aux=moe,
        metrics=functools.partial(_moe_metrics, cfg, mesh) if moe else None,
    )  # fmt: skip


def _moe_metrics(
    cfg: GPTConfig, mesh: Any, counts: jax.Array, y: jax.Array
) -> dict[str, jax.Array]:
    """Tokens per expert, dropped assignments and their fraction of the routed ones, from the
    counts [E + 1] summed over the layers (global: the same on every device) and this
    device's targets y (their global count: the routed tokens)."""
    per_expert, dropped = counts[:-1], counts[-1]
    tokens = y.size * mesh.shape["data"] * mesh.shape["expert"] * mesh.shape["seq"]
    routed = tokens * (cfg.experts.top_k if cfg.experts else 0) * cfg.layers
    return {"tokens_per_expert": per_expert, "dropped": dropped,
            "dropped_fraction": dropped / routed}  # fmt: skip
