"""How the engine calls a user's chunk (``pipeline_grads``'s ``stage_fn``): ``bound`` gives it
its microbatch's side inputs and, when it returns an aux loss, makes B's vjp of y alone carry
that loss's gradient (``_aux_gradient``: identity forward, a cotangent of 1 to the aux loss
backward), so the stash, the split backward and the masked phases need nothing new. A chunk
may also return metrics (``(y, aux_loss, metrics)``: a MoE layer's routing counts), which the
engine sums over every forward it runs and carries no gradient for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from shardkit.parallel.vma import vary, varying_axes


def bound(stage_fn: Callable[..., Any], side: Any, micro: Any, aux: bool) -> Callable[..., Any]:
    """The chunk as ``(chunk_params, x[, micro]) -> (y, (aux loss, metrics or None) or None)``,
    for ``jax.vjp`` with ``has_aux``: with side inputs, microbatch ``micro``'s (given now, or
    per call when None); with an aux loss, y carries its gradient (``_aux_gradient``), and the
    metrics none (``stop_gradient``)."""

    def chunk(p: Any, x: jax.Array, m: Any = micro) -> tuple[jax.Array, Any]:
        side_m = () if side is None else (jax.tree.map(lambda a: a[m], side),)
        out = stage_fn(p, x, *side_m)
        if not aux:
            return out, None
        if not (isinstance(out, tuple) and len(out) in (2, 3)):
            raise ValueError("With aux=True, stage_fn must return (y, aux_loss[, metrics]).")
        y, aux_loss, *rest = out
        metrics = jax.lax.stop_gradient(rest[0]) if rest else None
        return _aux_gradient(y, aux_loss), (aux_loss, metrics)

    return chunk


@jax.custom_vjp
def _aux_gradient(y: jax.Array, aux_loss: jax.Array) -> jax.Array:
    """y; in the backward, the chunk's aux loss gets its cotangent of 1 too (it is a term of
    the loss), so B's vjp of y alone computes the aux loss's gradient."""
    return y


def _aux_gradient_fwd(y: jax.Array, aux_loss: jax.Array) -> tuple[jax.Array, jax.Array]:
    return y, aux_loss


def _aux_gradient_bwd(aux_loss: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    return dy, vary(jnp.ones((), aux_loss.dtype), varying_axes(aux_loss))


_aux_gradient.defvjp(_aux_gradient_fwd, _aux_gradient_bwd)
