"""Token layouts for sequence parallelism: which global positions each device holds.

A sequence of T = n·t tokens split over a mesh axis of n devices, t per device:

  contiguous  device j holds tokens j·t ... (j+1)·t − 1 (a plain ``P(..., "seq", ...)`` split);
  zigzag      the sequence cut in 2n chunks of t/2; device j holds chunks j and 2n−1−j
              (Megatron-CP's and ring-flash-attention's load balancing): under a causal mask
              every device then has the same number of visible (query, key) pairs;
  striped     device j holds tokens j, j+n, j+2n, ... (Striped Attention, Brandon et al. 2023).

``to_layout`` permutes a global array so that the contiguous split of its result gives each
device its layout's tokens; ``from_layout`` is its exact inverse. Attention needs no other
change than the positions: ``positions(layout, n, t)[j]`` are the global positions of device
j's tokens, from which every device computes causal and padding masks itself (a static table:
nothing travels). Use outside ``shard_map`` for the permutations; inside, index the table with
``axis_index``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from shardkit.mesh import PlanError

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout: str, n: int, t: int) -> None:
    """PlanError unless ``layout`` is known and t tokens per device fit it (zigzag: t even)."""
    if layout not in LAYOUTS:
        raise PlanError(f"Unknown token layout {layout!r}; choose one of {', '.join(LAYOUTS)}.")
    if layout == "zigzag" and n > 1 and t % 2:
        raise PlanError(
            f"The zigzag layout gives each device two chunks of t/2 tokens, but t={t} tokens per "
            f"device is odd; pad the sequence to a multiple of 2·n = {2 * n}."
        )


def positions(layout: str, n: int, t: int) -> np.ndarray:
    """int32 [n, t]: row j holds the global positions of device j's tokens, in local order."""
    check_layout(layout, n, t)
    total = np.arange(n * t, dtype=np.int32)
    if layout == "striped":
        return total.reshape(t, n).T.copy()
    if layout == "zigzag" and n > 1:
        chunks = total.reshape(2 * n, t // 2)
        return np.concatenate([chunks[:n], chunks[::-1][:n]], axis=1)
    return total.reshape(n, t)


def local_positions(layout: str, axis: str | None, t: int) -> Array:
    """Inside ``shard_map``: int32 [t], the global positions of this device's t tokens along
    ``axis`` in ``layout`` (None: ``0 .. t−1``). What RoPE, causal masks and position
    embeddings must use: the local index is the wrong position on every device but the first
    (and on the first too under zigzag or striped)."""
    if axis is None:
        return jnp.arange(t, dtype=jnp.int32)
    n = jax.lax.axis_size(axis)
    return jnp.asarray(positions(layout, n, t))[jax.lax.axis_index(axis)]


def multiple(layout: str, n: int) -> int:
    """The multiple a global token count must be padded to for ``layout`` over n devices."""
    return 2 * n if layout == "zigzag" and n > 1 else n


def to_layout(x: Array, n: int, layout: str, axis: int = 1) -> Array:
    """Reorders the tokens of global ``x`` (along ``axis``) into ``layout`` over n devices.

    ``x.shape[axis]`` must divide by ``multiple(layout, n)`` (PlanError otherwise: no token is
    ever dropped). The contiguous split of the result over n devices holds, on device j, the
    tokens at ``positions(layout, n, t)[j]``.
    """
    order = positions(layout, n, _per_device(x.shape[axis], n, layout)).reshape(-1)
    return jnp.take(x, jnp.asarray(order), axis=axis)


def from_layout(x: Array, n: int, layout: str, axis: int = 1) -> Array:
    """The inverse of ``to_layout``: tokens back in sequence order (an exact permutation)."""
    order = positions(layout, n, _per_device(x.shape[axis], n, layout)).reshape(-1)
    return jnp.take(x, jnp.asarray(np.argsort(order)), axis=axis)


def _per_device(tokens: int, n: int, layout: str) -> int:
    """Tokens per device; PlanError naming the fix if ``tokens`` does not fit the layout."""
    if layout not in LAYOUTS:
        check_layout(layout, n, 0)
    if tokens % multiple(layout, n):
        raise PlanError(
            f"{tokens} tokens do not split over {n} devices in the {layout} layout; pad the "
            f"sequence to a multiple of {multiple(layout, n)} first (sequence.pad_tokens)."
        )
    return tokens // n
