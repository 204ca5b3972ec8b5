"""Backend-specific local compute, below ``parallel``: the primitives there choose a kernel here.

``attention``: one block of queries against one block of keys on JAX's Pallas splash-attention
TPU kernels (forward with the log-sum-exp, backward from a given log-sum-exp), under a static
mask built from token positions; on a CPU it runs in Pallas' interpret mode.
"""

from shardkit.kernels.attention import (
    KERNELS,
    MASK_VALUE,
    HopMask,
    attend,
    block_attention,
    block_attention_grads,
    full_mask,
    hop_masks,
    local_mask,
    resolve_kernel,
)

__all__ = [
    "KERNELS",
    "MASK_VALUE",
    "HopMask",
    "attend",
    "block_attention",
    "block_attention_grads",
    "full_mask",
    "hop_masks",
    "local_mask",
    "resolve_kernel",
]
