"""vit_ref: the unsharded reference Vision Transformer (big_vision-compatible, plain JAX)."""

from vit_ref.config import VARIANT_NAMES, ViTConfig, variant
from vit_ref.model import LAYERS, Params, as_layers, forward, init, param_axes, posemb_sincos2d
from vit_ref.train import (
    accumulated_grads,
    accuracy,
    cross_entropy,
    loss_fn,
    make_eval_step,
    make_optimizer,
    make_train_step,
)

__all__ = [
    "LAYERS",
    "VARIANT_NAMES",
    "Params",
    "ViTConfig",
    "accumulated_grads",
    "accuracy",
    "as_layers",
    "cross_entropy",
    "forward",
    "init",
    "loss_fn",
    "make_eval_step",
    "make_optimizer",
    "make_train_step",
    "param_axes",
    "posemb_sincos2d",
    "variant",
]
