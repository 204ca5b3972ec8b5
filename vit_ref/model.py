"""The reference Vision Transformer: init and forward in plain JAX arrays.

Architecture-compatible with big_vision's ``models/vit.py`` (same parameter shapes, inits and
numerics). This is the unsharded twin of everything in ``shardkit``.

Dimension alphabet (used in every einsum and shape comment of the project):
  b batch, t tokens (q query tokens, s key tokens), d width, h heads, k head dim,
  f MLP hidden, p patch features (patch * patch * channels), o output classes, l layers.

Params are a nested dict of arrays. Per-layer params are stacked along a leading ``l`` axis and
the blocks run under ``lax.scan``, or unrolled over the same stack; or, as big_vision keeps them,
each layer's params are its own arrays, a list of per-layer trees under ``blocks``
(``as_layers``), run unrolled (``forward``'s ``layers``).
``param_axes`` gives, for every leaf, its logical axis names;
sharded code maps those names to mesh axes in one rules table instead of scattering specs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import einops
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from vit_ref.config import ViTConfig

Params = dict[str, Any]
LN_EPS = 1e-6

_xavier = jax.nn.initializers.xavier_uniform()
_lecun = jax.nn.initializers.lecun_normal()


# Block recomputation policies (``jax.checkpoint``), by name; "none" keeps everything. Under
# ``lax.scan`` nothing is recomputed unless asked: every intermediate the backward reads is
# stacked per layer, the float32 attention scores and GELU inputs included ("none" holds
# 7.3 GB at ViT-B/16, batch 32, bf16, on a v5e; "dots" 2.7 GB: docs/performance.md).
REMAT: dict[str, Any] = {
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


# How the blocks run: "scan" and "unrolled" over the stacked params, "list" over per-layer ones.
LAYERS = ("scan", "unrolled", "list")


def as_layers(params: Params, layers: str) -> Params:
    """``params`` in the form ``layers`` runs (``LAYERS``): ``blocks`` as one stacked tree
    ([l, ...] leaves) for "scan" and "unrolled", as a list of per-layer trees for "list"
    (each layer's weights its own arrays: XLA fuses a layer's optimizer update into its
    gradient's matmul, where a stack needs the gradient assembled first). Also works on any
    params-shaped tree (gradients, optimizer moments); a copy only when the form changes."""
    if layers not in LAYERS:
        raise ValueError(f"Unknown layers {layers!r}; choose one of {', '.join(LAYERS)}.")
    blocks = params["blocks"]
    if (layers == "list") == isinstance(blocks, list):
        return params
    if layers == "list":
        depth = jax.tree.leaves(blocks)[0].shape[0]
        return {**params, "blocks": [layer(blocks, i) for i in range(depth)]}
    return {**params, "blocks": jax.tree.map(lambda *a: jnp.stack(a), *blocks)}


def layer(blocks: Params | list[Params], i: int) -> Params:
    """Layer ``i``'s params from the stacked blocks or the list of per-layer ones."""
    if isinstance(blocks, list):
        return blocks[i]
    return jax.tree.map(lambda a: a[i], blocks)


def check_layers(blocks: Any, layers: str) -> None:
    """ValueError unless ``blocks`` is in the form ``layers`` runs (``as_layers``)."""
    if layers == "list" and not isinstance(blocks, list):
        raise ValueError(
            "layers='list' runs per-layer params (params['blocks'] a list); these are stacked: "
            "pass vit_ref.as_layers(params, 'list')."
        )
    if layers != "list" and isinstance(blocks, list):
        raise ValueError(
            f"layers={layers!r} runs stacked params; params['blocks'] is a list of layers: pass "
            f"vit_ref.as_layers(params, {layers!r}), or run them with layers='list'."
        )


def run_layers(
    fn: Callable[[Array, Any], Array], x: Array, stacked: Any, layers: str
) -> tuple[Array, list[Array]]:
    """(output, every layer's output) of ``x = fn(x, layer_i)`` over the leading axis of
    ``stacked``, as one ``lax.scan`` or unrolled, or over a list of layers (``LAYERS``)."""
    if layers == "scan":

        def body(x: Array, p: Any) -> tuple[Array, Array]:
            y = fn(x, p)
            return y, y

        x, ys = jax.lax.scan(body, x, stacked)
        depth = jax.tree.leaves(stacked)[0].shape[0]
        return x, [jax.tree.map(lambda a, i=i: a[i], ys) for i in range(depth)]
    if layers not in LAYERS:
        raise ValueError(f"Unknown layers {layers!r}; choose one of {', '.join(LAYERS)}.")
    depth = len(stacked) if layers == "list" else jax.tree.leaves(stacked)[0].shape[0]
    outs = []
    for i in range(depth):
        x = fn(x, stacked[i] if layers == "list" else layer(stacked, i))
        outs.append(x)
    return x, outs


def remat_block(fn: Callable[..., Any], policy: str) -> Callable[..., Any]:
    """``fn`` under ``jax.checkpoint`` with the named policy ("none": ``fn`` itself)."""
    if policy == "none":
        return fn
    if policy not in REMAT:
        raise ValueError(f"Unknown remat policy {policy!r}; choose none, {', '.join(REMAT)}.")
    return jax.checkpoint(fn, policy=REMAT[policy])


def compute_dtype(cfg: ViTConfig) -> jnp.dtype | None:
    """bfloat16 for bf16 compute; None (keep the params' dtype) for float32."""
    return jnp.dtype(jnp.bfloat16) if cfg.dtype == "bfloat16" else None


def residual_dtype(cfg: ViTConfig, params: Params) -> jnp.dtype:
    """The residual stream's dtype: the params' (float32), or under ``precision="big_vision"``
    the compute dtype."""
    compute = compute_dtype(cfg)
    if cfg.precision == "big_vision" and compute is not None:
        return compute
    return jnp.dtype(params["embedding"]["kernel"].dtype)


def softmax_dtype(cfg: ViTConfig) -> jnp.dtype | None:
    """Attention's logits and softmax dtype: None (at least float32), or under
    ``precision="big_vision"`` the compute dtype."""
    return compute_dtype(cfg) if cfg.precision == "big_vision" else None


def at_least_f32(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype for softmax, LayerNorm and loss: float32, or wider if the input is wider."""
    return jnp.dtype(jnp.float64 if dtype == jnp.float64 else jnp.float32)


def cast(x: Array, dtype: jnp.dtype | None) -> Array:
    return x if dtype is None else x.astype(dtype)


# ----------------------------------------------------------------------------- init


@functools.partial(jax.jit, static_argnums=1)
def init(key: jax.Array, cfg: ViTConfig) -> Params:
    """Draws fresh float32 params for ``cfg`` (deterministic in ``key``), as one compiled
    program: run op by op it would compile each of its ~60 ops in turn."""
    k_embed, k_pos, k_blocks, k_head = jax.random.split(key, 4)
    d = cfg.dim
    params: Params = {
        "embedding": {
            "kernel": _lecun(k_embed, (cfg.patch_features, d), jnp.float32),
            "bias": jnp.zeros((d,), jnp.float32),
        },
    }
    if cfg.posemb == "learn":
        std = 1.0 / np.sqrt(d)
        params["pos_embedding"] = std * jax.random.normal(k_pos, (1, cfg.num_patches, d))
    if cfg.pool == "tok":
        params["cls"] = jnp.zeros((1, 1, d), jnp.float32)
    params["blocks"] = jax.vmap(lambda k: _init_block(k, cfg))(
        jax.random.split(k_blocks, cfg.depth)
    )
    params["encoder_norm"] = _init_layer_norm(d)
    params["head"] = _init_head(k_head, cfg)
    return params


def _init_layer_norm(d: int) -> Params:
    return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}


def _init_block(key: jax.Array, cfg: ViTConfig) -> Params:
    kq, kk, kv, ko, k1, k2, kb1, kb2 = jax.random.split(key, 8)
    d, h, k, f = cfg.dim, cfg.heads, cfg.head_dim, cfg.mlp_dim

    def proj_in(key: jax.Array) -> Params:
        # flax DenseGeneral draws the kernel flat [d, h*k], then reshapes.
        kernel = _xavier(key, (d, h * k), jnp.float32).reshape(d, h, k)
        return {"kernel": kernel, "bias": jnp.zeros((h, k), jnp.float32)}

    return {
        "ln1": _init_layer_norm(d),
        "attn": {
            "query": proj_in(kq),
            "key": proj_in(kk),
            "value": proj_in(kv),
            "out": {
                "kernel": _xavier(ko, (h * k, d), jnp.float32).reshape(h, k, d),
                "bias": jnp.zeros((d,), jnp.float32),
            },
        },
        "ln2": _init_layer_norm(d),
        "mlp": {
            "fc1": {
                "kernel": _xavier(k1, (d, f), jnp.float32),
                "bias": 1e-6 * jax.random.normal(kb1, (f,)),
            },
            "fc2": {
                "kernel": _xavier(k2, (f, d), jnp.float32),
                "bias": 1e-6 * jax.random.normal(kb2, (d,)),
            },
        },
    }


def _init_head(key: jax.Array, cfg: ViTConfig) -> Params:
    shape = (cfg.dim, cfg.classes)
    kernel = jnp.zeros(shape) if cfg.head_zeroinit else _xavier(key, shape, jnp.float32)
    return {"kernel": kernel, "bias": jnp.zeros((cfg.classes,), jnp.float32)}


def param_axes(cfg: ViTConfig, layers: str = "scan") -> Params:
    """Logical axis names of every param leaf (same tree structure as ``init``, or with
    ``layers="list"`` as ``as_layers(init(...), "list")``: per-layer leaves have no "layers")."""
    ln = {"scale": ("embed",), "bias": ("embed",)}
    stacked = lambda tree: jax.tree.map(  # noqa: E731
        lambda names: ("layers", *names), tree, is_leaf=lambda x: isinstance(x, tuple)
    )
    proj_in = {"kernel": ("embed", "heads", "head_dim"), "bias": ("heads", "head_dim")}
    block = {
        "ln1": ln,
        "attn": {
            "query": proj_in,
            "key": proj_in,
            "value": proj_in,
            "out": {"kernel": ("heads", "head_dim", "embed"), "bias": ("embed",)},
        },
        "ln2": ln,
        "mlp": {
            "fc1": {"kernel": ("embed", "mlp"), "bias": ("mlp",)},
            "fc2": {"kernel": ("mlp", "embed"), "bias": ("embed",)},
        },
    }
    axes: Params = {"embedding": {"kernel": ("patch_in", "embed"), "bias": ("embed",)}}
    if cfg.posemb == "learn":
        axes["pos_embedding"] = (None, "tokens", "embed")
    if cfg.pool == "tok":
        axes["cls"] = (None, None, "embed")
    axes["blocks"] = [block] * cfg.depth if layers == "list" else stacked(block)
    axes["encoder_norm"] = ln
    axes["head"] = {"kernel": ("embed", "classes"), "bias": ("classes",)}
    return axes


# ----------------------------------------------------------------------------- layers


def posemb_sincos2d(grid: int, dim: int, temperature: float = 10_000.0) -> np.ndarray:
    """big_vision's fixed 2-D sin-cos position embedding, shape [1, grid*grid, dim]."""
    y, x = np.mgrid[:grid, :grid]
    omega = np.arange(dim // 4) / (dim // 4 - 1)
    omega = 1.0 / (temperature**omega)
    y = np.einsum("m,d->md", y.flatten(), omega)
    x = np.einsum("m,d->md", x.flatten(), omega)
    pe = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
    return pe[None].astype(np.float32)


def layer_norm(x: Float[Array, "... d"], p: Params) -> Float[Array, "... d"]:
    """LayerNorm over the last axis in float32 (eps 1e-6); returns x's dtype."""
    x32 = x.astype(at_least_f32(x.dtype))
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + LN_EPS)
    return add_bias(y * expand_to(p["scale"], y), p["bias"]).astype(x.dtype)


def dense(x: Array, p: Params, spec: str, dtype: jnp.dtype | None) -> Array:
    """``einsum(spec, x, kernel) + bias`` computed in ``dtype`` (None: the inputs' dtype)."""
    y = jnp.einsum(spec, cast(x, dtype), cast(p["kernel"], dtype))
    return add_bias(y, cast(p["bias"], dtype))


def expand_to(b: Array, y: Array) -> Array:
    """``b`` with leading unit axes added to match ``y``'s rank (explicit broadcasting)."""
    return b.reshape((1,) * (y.ndim - b.ndim) + b.shape)


def add_bias(y: Array, b: Array) -> Array:
    """``y + b`` with ``b`` broadcast over ``y``'s leading axes."""
    return y + expand_to(b, y)


def gelu(x: Array) -> Array:
    """GELU, tanh approximation (flax's ``nn.gelu`` default)."""
    return jax.nn.gelu(x, approximate=True)


def attention_core(
    q: Float[Array, "b q h k"],
    k: Float[Array, "b s h k"],
    v: Float[Array, "b s h k"],
    key_mask: Float[Array, "b s"] | None = None,
    scores: jnp.dtype | None = None,
) -> Float[Array, "b q h k"]:
    """Softmax(q kᵀ / sqrt(k)) v; masked keys get zero weight.

    q is scaled before the product (a [b, q, h, k] multiply, not one over the scores). The
    logits and softmax are in ``scores`` (None: at least float32); the probabilities enter the
    second product in v's dtype. (A float64 NumPy scale would promote bf16 logits to float32:
    the scale is a Python float.)
    """
    wide = jnp.dtype(scores) if scores is not None else at_least_f32(q.dtype)
    q = q * float(1.0 / np.sqrt(q.shape[-1]))
    logits = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=wide)
    if key_mask is not None:
        logits = jnp.where(key_mask[:, None, None, :], logits, jnp.finfo(wide).min / 2)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", probs, v)


def self_attention(
    x: Float[Array, "b t d"], p: Params, dtype: jnp.dtype | None, scores: jnp.dtype | None = None
) -> Float[Array, "b t d"]:
    """Multi-head self-attention with q, k, v and out projections (all with biases)."""
    q = dense(x, p["query"], "btd,dhk->bthk", dtype)
    k = dense(x, p["key"], "btd,dhk->bthk", dtype)
    v = dense(x, p["value"], "btd,dhk->bthk", dtype)
    o = attention_core(q, k, v, scores=scores)
    return dense(o, p["out"], "bthk,hkd->btd", dtype)


def mlp(x: Float[Array, "b t d"], p: Params, dtype: jnp.dtype | None) -> Float[Array, "b t d"]:
    """Dense -> GELU (tanh) -> dense."""
    y = gelu(dense(x, p["fc1"], "btd,df->btf", dtype))
    return dense(y, p["fc2"], "btf,fd->btd", dtype)


def block(
    x: Float[Array, "b t d"], p: Params, dtype: jnp.dtype | None, scores: jnp.dtype | None = None
) -> Float[Array, "b t d"]:
    """Pre-LN encoder block; the residual stream keeps x's dtype (``residual_dtype``)."""
    x = x + self_attention(layer_norm(x, p["ln1"]), p["attn"], dtype, scores).astype(x.dtype)
    return x + mlp(layer_norm(x, p["ln2"]), p["mlp"], dtype).astype(x.dtype)


# ----------------------------------------------------------------------------- model


def patchify(images: Float[Array, "b H W c"], patch: int) -> Float[Array, "b t p"]:
    """Non-overlapping patches, flattened (row, col, channel) like a conv kernel [p, p, c, d]."""
    return einops.rearrange(
        images, "b (gh ph) (gw pw) c -> b (gh gw) (ph pw c)", ph=patch, pw=patch
    )


def embed(params: Params, images: Float[Array, "b H W c"], cfg: ViTConfig) -> Float[Array, "b t d"]:
    """Patch embedding + position embedding, then the class token for ``pool='tok'``, in the
    residual stream's dtype (``residual_dtype``)."""
    if images.ndim != 4 or images.shape[1:] != (cfg.image, cfg.image, cfg.channels):
        raise ValueError(
            f"images must have shape [b, {cfg.image}, {cfg.image}, {cfg.channels}] (NHWC), "
            f"got {tuple(images.shape)}."
        )
    dtype = compute_dtype(cfg)
    x = dense(patchify(images, cfg.patch), params["embedding"], "btp,pd->btd", dtype)
    stream = residual_dtype(cfg, params)
    x = x.astype(stream) + position_embedding(params, cfg).astype(stream)
    if cfg.pool == "tok":
        cls = jnp.broadcast_to(params["cls"].astype(stream), (x.shape[0], 1, cfg.dim))
        x = jnp.concatenate([cls, x], axis=1)
    return x


def position_embedding(params: Params, cfg: ViTConfig) -> Float[Array, "1 t d"]:
    if cfg.posemb == "learn":
        return params["pos_embedding"]
    return jnp.asarray(posemb_sincos2d(cfg.grid, cfg.dim))


def pool(x: Float[Array, "b t d"], cfg: ViTConfig) -> Float[Array, "b d"]:
    return x[:, 0] if cfg.pool == "tok" else x.mean(axis=1)


def forward(
    params: Params,
    images: Float[Array, "b H W c"],
    cfg: ViTConfig,
    constrain: Callable[[Array], Array] | None = None,
    remat: str = "none",
    layers: str = "scan",
) -> tuple[Float[Array, "b o"], dict[str, Array]]:
    """Logits and named intermediates.

    Args:
      params: a pytree from ``init(key, cfg)``.
      images: float images, shape [b, image, image, channels] (NHWC).
      cfg: the model config.
      constrain: applied to the tokens [b, t, d] after the embedding and at every block's
        input, e.g. a ``jax.lax.with_sharding_constraint`` that asks XLA's automatic
        partitioner to split tokens (the reference itself never needs it).
      remat: the blocks' recomputation policy (``REMAT``: "none", "dots" or "full"); the
        values are the same, only what the backward keeps differs.
      layers: how the blocks run (``LAYERS``): "scan" (``lax.scan`` over the stacked params: one
        compiled body), "unrolled" (a Python loop over the same stacked params: XLA sees
        and fuses every layer; 1.3x faster on a v5e at ViT-B/16, longer to compile) or "list"
        (a Python loop over per-layer params, ``as_layers(params, "list")``: each layer's
        AdamW update fused into its gradient; another 2% on a v5e, docs/performance.md).

    Returns:
      logits of shape [b, classes] (float32), and a dict with ``embedding`` [b, t, d],
      ``block_{i}`` [b, t, d] for each layer i, ``encoded`` [b, t, d] (after the final norm) and
      ``pre_logits`` [b, d] (pooled features).
    """
    dtype = compute_dtype(cfg)
    constrain = constrain or (lambda x: x)
    x = constrain(embed(params, images, cfg))
    inter: dict[str, Array] = {"embedding": x}

    check_layers(params["blocks"], layers)
    scores = softmax_dtype(cfg)
    run_block = remat_block(lambda x, p: block(constrain(x), p, dtype, scores), remat)
    x, per_layer = run_layers(run_block, x, params["blocks"], layers)
    inter.update({f"block_{i}": y for i, y in enumerate(per_layer)})
    x = inter["encoded"] = layer_norm(x, params["encoder_norm"])
    x = inter["pre_logits"] = pool(x, cfg)
    logits = dense(x, params["head"], "bd,do->bo", dtype)
    logits = logits.astype(at_least_f32(logits.dtype))
    return logits, inter
