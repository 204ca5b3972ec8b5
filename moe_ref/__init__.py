"""moe_ref: the unsharded reference mixture-of-experts layer, float32, one token at a time.

Written apart from ``shardkit.parallel.moe`` (no buffers, no cumsum, no collectives), so that
sharded == reference tests two implementations of one rule:

- routing: scores (softmax, or sigmoid) of x · router; the k experts by a stable descending
  sort (the highest score first, ties to the lower id); combine weights the chosen scores,
  divided by their sum if ``normalize``;
- drops: the tokens are cut into groups (the sharded run's devices); in each group the k·n
  assignments are visited one by one in the drop order (``"choice"``: all first choices in
  token order, then all second choices...; ``"score"``: by descending weight, ties in that
  order) and one keeps a slot while its expert has had fewer than C visits, C =
  ceil(capacity_factor · n · k / E) (at least 1), or n when ``capacity_factor`` is None;
- output: per token, each kept choice's expert (SwiGLU with that expert's own weights)
  applied to the token, times its weight, summed over the k choices;
- losses: Switch's E · Σ_e f_e P_e over all tokens (or per sequence, averaged, for
  ``aux="sequence"``) and the router z-loss, mean logsumexp(logits)².

``cfg`` is anything with the fields of ``shardkit.parallel.moe.MoE`` (experts, top_k,
capacity_factor, score, normalize, order, aux).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
HIGHEST = jax.lax.Precision.HIGHEST


def route(x: Array, router: Array, cfg: Any) -> tuple[Array, Array, Array, Array]:
    """(experts [n, k], weights [n, k], probs [n, E], logits [n, E]) of tokens x [n, d]."""
    logits = jnp.dot(x, router, precision=HIGHEST)
    if cfg.score == "softmax":
        scores = probs = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
    experts = jnp.argsort(-scores, axis=-1, stable=True)[:, : cfg.top_k]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return experts, weights, probs, logits


def capacity(cfg: Any, n: int) -> int:
    if cfg.capacity_factor is None:
        return n
    return max(1, math.ceil(cfg.capacity_factor * n * cfg.top_k / cfg.experts))


def kept(experts: Array, weights: Array, cfg: Any) -> Array:
    """kept [n, k]: the assignments visited in drop order, each counted against its expert."""
    n, k = experts.shape
    flat_e, flat_w = experts.T.reshape(-1), weights.T.reshape(-1)
    visits = jnp.arange(n * k)
    if cfg.order == "score":
        visits = jnp.argsort(-flat_w, stable=True)
    limit = capacity(cfg, n)

    def visit(seen: Array, a: Array) -> tuple[Array, Array]:
        e = flat_e[a]
        return seen.at[e].add(1), seen[e] < limit

    _, keep = jax.lax.scan(visit, jnp.zeros(cfg.experts, jnp.int32), visits)
    return jnp.zeros(n * k, bool).at[visits].set(keep).reshape(k, n).T


def expert(p: dict[str, Array], e: Array, x: Array) -> Array:
    """Expert e[t] applied to token x[t], one token at a time (its own weights gathered)."""
    gate, up, down = p["gate"][e], p["up"][e], p["down"][e]  # [n, d, F], [n, d, F], [n, F, d]
    h = jax.nn.silu(jnp.einsum("nd,ndf->nf", x, gate, precision=HIGHEST))
    h = h * jnp.einsum("nd,ndf->nf", x, up, precision=HIGHEST)
    return jnp.einsum("nf,nfd->nd", h, down, precision=HIGHEST)


def group_layer(p: dict[str, Array], x: Array, cfg: Any) -> dict[str, Array]:
    """One group's tokens x [n, d]: the output and what the losses and counts need."""
    experts, weights, probs, logits = route(x, p["router"], cfg)
    keep = kept(experts, weights, cfg)
    out = jnp.zeros_like(x)
    for j in range(cfg.top_k):  # each choice's expert, token by token
        w = jnp.where(keep[:, j], weights[:, j], 0.0)
        out = out + w[:, None] * expert(p, experts[:, j], x)
    return {"out": out, "experts": experts, "probs": probs, "logits": logits, "kept": keep}


def to_groups(x: Array, groups: tuple[int, int]) -> Array:
    """x [B, T, d] -> [gb·gs, B/gb · T/gs, d]: gb batch blocks by gs token blocks, each group's
    tokens in row-major (b, t) order (a device's local tokens under a contiguous layout)."""
    gb, gs = groups
    b, t, d = x.shape
    blocks = x.reshape(gb, b // gb, gs, t // gs, d).transpose(0, 2, 1, 3, 4)
    return blocks.reshape(gb * gs, (b // gb) * (t // gs), d)


def from_groups(y: Array, groups: tuple[int, int], shape: tuple[int, ...]) -> Array:
    """The inverse of ``to_groups``."""
    gb, gs = groups
    b, t, d = shape
    blocks = y.reshape(gb, gs, b // gb, t // gs, d).transpose(0, 2, 1, 3, 4)
    return blocks.reshape(b, t, d)


def load_balance(experts: Array, probs: Array, cfg: Any) -> Array:
    """Switch's E · Σ_e f_e · P_e over the tokens given ([N, k] ids, [N, E] probs)."""
    f = jax.nn.one_hot(experts, cfg.experts).sum((0, 1)) / experts.size
    return cfg.experts * jnp.sum(f * probs.mean(0))


def layer(
    p: dict[str, Array], x: Array, cfg: Any, groups: tuple[int, int] = (1, 1)
) -> tuple[Array, dict[str, Array]]:
    """The MoE layer on x [B, T, d] routed in ``groups`` (batch blocks, token blocks):
    (out [B, T, d], {load_balance, router_z, tokens_per_expert, dropped})."""
    per_group = [group_layer(p, g, cfg) for g in to_groups(x, groups)]
    stack = {k: jnp.stack([g[k] for g in per_group]) for k in per_group[0]}
    out = from_groups(stack["out"], groups, x.shape)
    b, t, _ = x.shape
    experts = from_groups(stack["experts"], groups, (b, t, cfg.top_k))
    probs = from_groups(stack["probs"], groups, (b, t, cfg.experts))
    if cfg.aux == "batch":
        lb = load_balance(experts.reshape(b * t, -1), probs.reshape(b * t, -1), cfg)
    else:
        lb = jnp.mean(jax.vmap(lambda e, q: load_balance(e, q, cfg))(experts, probs))
    lse = jax.nn.logsumexp(stack["logits"], axis=-1)
    aux = {
        "load_balance": lb,
        "router_z": jnp.mean(lse**2),
        "tokens_per_expert": jax.nn.one_hot(experts, cfg.experts).sum((0, 1, 2)),
        "dropped": jnp.sum(~stack["kept"]),
    }
    return out, aux
