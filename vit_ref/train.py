"""Loss, accuracy and the unsharded optax train / eval steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int

from vit_ref.config import ViTConfig
from vit_ref.model import Params, at_least_f32, forward

TrainStep = Callable[[Params, Any, Array, Array], tuple[Params, Any, dict[str, Array]]]


def cross_entropy(logits: Float[Array, "b o"], labels: Int[Array, " b"]) -> Float[Array, ""]:
    """Mean softmax cross-entropy with integer labels, in float32."""
    logits = logits.astype(at_least_f32(logits.dtype))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return losses.mean()


def accuracy(logits: Float[Array, "b o"], labels: Int[Array, " b"]) -> Float[Array, ""]:
    return (logits.argmax(-1) == labels).astype(jnp.float32).mean()


def loss_fn(
    params: Params,
    images: Float[Array, "b H W c"],
    labels: Int[Array, " b"],
    cfg: ViTConfig,
    constrain: Callable[[Array], Array] | None = None,
    remat: str = "none",
    layers: str = "scan",
) -> Float[Array, ""]:
    """The training objective: cross-entropy of the reference forward (``constrain``,
    ``remat``, ``layers``: see ``forward``)."""
    logits, _ = forward(params, images, cfg, constrain, remat, layers)
    return cross_entropy(logits, labels)


def make_optimizer(
    learning_rate: float | optax.Schedule = 1e-3,
    weight_decay: float = 1e-4,
    clip_norm: float | None = None,
) -> optax.GradientTransformation:
    """AdamW, the optimizer shared by the reference and every sharded train step.

    ``learning_rate`` may be a schedule (``optax.warmup_cosine_decay_schedule``); ``clip_norm``
    first clips the gradients to that global norm (``optax.clip_by_global_norm``).
    """
    adamw = optax.adamw(learning_rate, weight_decay=weight_decay)
    return adamw if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), adamw)


def apply_optimizer(
    optimizer: optax.GradientTransformation, grads: Params, opt_state: Any, params: Params
) -> tuple[Params, Any]:
    """One optax update. optax mixes Python floats with int32 step counts, which strict dtype
    promotion (on in our tests, to check our own code) rejects, so it runs under "standard"."""
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state


def make_train_step(
    cfg: ViTConfig,
    optimizer: optax.GradientTransformation,
    remat: str = "dots",
    layers: str = "scan",
    microbatches: int = 1,
) -> TrainStep:
    """A jitted step ``(params, opt_state, images, labels) -> (params, opt_state, metrics)``.

    ``metrics``: ``loss`` and ``grad_norm`` (the global L2 norm of the gradients, before any
    clipping). params and opt_state are donated: pass fresh copies if you still need the old ones.
    ``remat``: the blocks' recomputation policy (``forward``); "dots" by default: under
    ``lax.scan`` "none" stacks every intermediate the backward reads, the float32 attention
    scores included (ViT-B/16, batch 32, bf16 on a v5e: 7.34 GB temp and 686 img/s against
    2.69 GB and 771 img/s with "dots"; docs/performance.md). ``layers``: "scan", "unrolled"
    or "list" (``forward``; "list" takes ``as_layers(params, "list")``); unrolled, "none" is the
    fastest and XLA keeps no per-layer stacks.
    ``microbatches``: gradient accumulation (``accumulated_grads``).
    """

    def grad_fn(params: Params, images: Array, labels: Array) -> tuple[Array, Params]:
        return jax.value_and_grad(loss_fn)(params, images, labels, cfg, None, remat, layers)

    def step(params: Params, opt_state: Any, images: Array, labels: Array):
        loss, grads = accumulated_grads(grad_fn, params, images, labels, microbatches)
        grad_norm = optax.tree.norm(grads)
        params, opt_state = apply_optimizer(optimizer, grads, opt_state, params)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm}

    return jax.jit(step, donate_argnums=(0, 1))


def accumulated_grads(
    grad_fn: Callable[[Params, Array, Array], tuple[Array, Params]],
    params: Params,
    images: Array,
    labels: Array,
    microbatches: int,
) -> tuple[Array, Params]:
    """``grad_fn(params, images, labels)``'s (loss, grads) averaged over ``microbatches`` equal
    slices of the batch, run one after another (``lax.scan``): the batch's mean loss and its
    gradients (up to float summation order), one micro-batch's activations live at a time and
    one gradient-sized sum carried."""
    if microbatches == 1:
        return grad_fn(params, images, labels)
    if images.shape[0] % microbatches:
        raise ValueError(
            f"batch {images.shape[0]} is not divisible by {microbatches} micro-batches."
        )
    split = lambda a: a.reshape(microbatches, -1, *a.shape[1:])  # noqa: E731

    def one(total: Params, batch: tuple[Array, Array]) -> tuple[Params, Array]:
        loss, grads = grad_fn(params, *batch)
        return jax.tree.map(jnp.add, total, grads), loss

    zeros = jax.tree.map(jnp.zeros_like, params)
    total, losses = jax.lax.scan(one, zeros, (split(images), split(labels)))
    return losses.mean(), jax.tree.map(lambda g: g / microbatches, total)


def make_eval_step(cfg: ViTConfig) -> Callable[[Params, Array, Array], dict[str, Array]]:
    """A jitted ``(params, images, labels) -> {"loss", "accuracy"}``."""

    def step(params: Params, images: Array, labels: Array) -> dict[str, Array]:
        logits, _ = forward(params, images, cfg)
        return {"loss": cross_entropy(logits, labels), "accuracy": accuracy(logits, labels)}

    return jax.jit(step)
