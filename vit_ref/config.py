"""ViT configuration: one frozen dataclass and big_vision's variant table.

A config is validated when it is made (including by ``dataclasses.replace``), so a model that
cannot work fails with a ``ValueError`` naming the field and the values, never deep inside XLA.
"""

from __future__ import annotations

import dataclasses
from typing import Any

POOLS = ("tok", "gap")
POSEMBS = ("learn", "sincos2d")
DTYPES = ("float32", "bfloat16")
# What stays float32 under bf16 compute (params, optimizer state, LayerNorm statistics and the
# loss always do): "wide" also keeps the residual stream and attention's logits and softmax in
# float32; "big_vision" computes both in bf16, as big_vision trains with dtype_mm=bfloat16.
PRECISIONS = ("wide", "big_vision")

# width, depth, mlp_dim, heads -- big_vision's decode_variant table, plus a tiny "mu" for tests.
VARIANTS: dict[str, dict[str, int]] = {
    "mu": dict(dim=32, depth=1, mlp_dim=128, heads=2),
    "Ti": dict(dim=192, depth=12, mlp_dim=768, heads=3),
    "S": dict(dim=384, depth=12, mlp_dim=1536, heads=6),
    "B": dict(dim=768, depth=12, mlp_dim=3072, heads=12),
    "L": dict(dim=1024, depth=24, mlp_dim=4096, heads=16),
    "H": dict(dim=1280, depth=32, mlp_dim=5120, heads=16),
}
VARIANT_NAMES = ("mu", "Ti/16", "S/16", "B/16", "L/16", "H/14")


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Shape and numerics of a ViT.

    Attributes:
      image: square image side in pixels (NHWC inputs of shape [b, image, image, channels]).
      patch: square patch side; must divide ``image``.
      channels: input channels.
      classes: number of output classes.
      dim: residual width d.
      depth: number of encoder blocks L.
      heads: attention heads h; head dim k = dim // heads.
      mlp_dim: MLP hidden width f.
      pool: "tok" (class token, prepended) or "gap" (mean over tokens).
      posemb: "learn" (normal, std 1/sqrt(dim)) or "sincos2d" (fixed).
      dtype: compute dtype of the matmuls, "float32" or "bfloat16" (params stay float32).
      precision: the mixed-precision policy under bf16 (``PRECISIONS``): "wide" keeps the
        residual stream, attention's logits and softmax, LayerNorm statistics and the loss in
        float32; "big_vision" keeps only LayerNorm statistics and the loss (the residual
        stream and the softmax in bf16; faster and lighter on a TPU: docs/performance.md).
        Both are the same under float32.
      head_zeroinit: zero-initialise the head kernel (big_vision's default); False draws it
        randomly, which equivalence tests need so that logits depend on the body.
    """

    image: int = 224
    patch: int = 16
    channels: int = 3
    classes: int = 1000
    dim: int = 768
    depth: int = 12
    heads: int = 12
    mlp_dim: int = 3072
    pool: str = "gap"
    posemb: str = "learn"
    dtype: str = "float32"
    precision: str = "wide"
    head_zeroinit: bool = True

    def __post_init__(self) -> None:
        for name in ("image", "patch", "channels", "classes", "dim", "depth", "heads", "mlp_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ViTConfig.{name} must be a positive integer, got {value!r}.")
        if self.image % self.patch:
            raise ValueError(
                f"ViTConfig.image={self.image} is not divisible by ViTConfig.patch={self.patch}."
            )
        if self.dim % self.heads:
            raise ValueError(
                f"ViTConfig.dim={self.dim} is not divisible by ViTConfig.heads={self.heads}."
            )
        _check_choice("pool", self.pool, POOLS)
        _check_choice("posemb", self.posemb, POSEMBS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("precision", self.precision, PRECISIONS)
        if self.posemb == "sincos2d" and (self.dim % 4 or self.dim < 8):
            raise ValueError(
                f"ViTConfig.posemb='sincos2d' needs dim divisible by 4 and at least 8, "
                f"got dim={self.dim}."
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def grid(self) -> int:
        """Patches per image side."""
        return self.image // self.patch

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid

    @property
    def num_tokens(self) -> int:
        """Tokens entering the encoder: patches, plus the class token for ``pool='tok'``."""
        return self.num_patches + (1 if self.pool == "tok" else 0)

    @property
    def patch_features(self) -> int:
        """Values in one flattened patch, p * p * c."""
        return self.patch * self.patch * self.channels


def _check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"ViTConfig.{field}={value!r} is not one of {', '.join(choices)}.")


def variant(name: str, **overrides: Any) -> ViTConfig:
    """Config for a named variant (``VARIANT_NAMES``: "mu", "Ti/16" ... "H/14"), overridable.

    "X/p" sets the patch size to p; the big variants default to 224px images and 1000 classes,
    "mu" to 32px images, patch 8 and 10 classes.
    """
    base, _, patch = name.partition("/")
    if base not in VARIANTS or (base == "mu") != (patch == "") or (patch and not patch.isdigit()):
        raise ValueError(f"Unknown ViT variant {name!r}; choose one of {', '.join(VARIANT_NAMES)}.")
    fields: dict[str, Any] = dict(VARIANTS[base])
    if base == "mu":
        fields.update(image=32, patch=8, classes=10)
    else:
        fields.update(patch=int(patch))
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(ViTConfig)})
    if unknown:
        raise ValueError(f"Unknown ViTConfig field(s) {', '.join(unknown)} in variant overrides.")
    fields.update(overrides)
    return ViTConfig(**fields)
