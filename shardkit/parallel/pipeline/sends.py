"""How a tick's activation and cotangent reach the stages that read them.

Each kind ("x": activations, chunk c−1 → c; "dy": cotangents, chunk c+1 → c) travels by
``ppermute`` over the schedule's pairs, grouped into permutations (``Tables.x_pairs`` /
``dy_pairs``). With one permutation (every schedule but ZBV above S = 2) every tick of a
sending segment runs it, with what the tick made or zeros. With several (ZBV's V: down it and
up it), a tick's value goes over one of them only, so a switch on the tick's bitmask
(``Tables.carried``, the same on every device) runs just the permutes that carry a value,
each branch under the named scope ``BRANCH_SCOPE.format(SEND_BRANCH[kind] + mask)`` so that a
ledger counts it by its ticks (``tables.branch_runs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from shardkit.parallel.pipeline.tables import BRANCH_SCOPE, SEND_BRANCH, Segment, Tables

Pairs = tuple[tuple[tuple[int, int], ...], ...]


@dataclasses.dataclass(frozen=True)
class Sends:
    """What a segment sends: whether activations (x) and cotangents (dy) go out each tick,
    and, for a kind over several permutes, the bitmasks its ticks use (``used``) and each
    tick's position among them (``positions``, scanned with the ticks)."""

    x: bool
    dy: bool
    used: dict[str, list[int]]
    positions: dict[str, np.ndarray]


def segment_sends(tab: Tables, segment: Segment) -> Sends:
    """The ``Sends`` of ``segment`` (``Tables.segments``' (start, stop, sends x, sends dy))."""
    used, positions = {}, {}
    for kind, masks in tab.switched(segment).items():
        used[kind] = sorted(set(masks.tolist()))
        positions[kind] = np.searchsorted(used[kind], masks).astype(np.int32)
    return Sends(segment[2], segment[3], used, positions)


def send(
    kind: str, out: jax.Array, sends: Sends, pairs: Pairs, axis: str, position: jax.Array | None
) -> list[jax.Array]:
    """What each of ``kind``'s permutes delivers this tick (``position``: the tick's place
    among ``sends.used[kind]``, for a kind over several permutes)."""
    if kind in sends.used:
        branches = [_carrying(kind, mask, pairs, axis) for mask in sends.used[kind]]
        return jax.lax.switch(position, branches, out)
    on = sends.x if kind == "x" else sends.dy
    return [jax.lax.ppermute(out, axis, p) if on else jnp.zeros_like(out) for p in pairs]


def _carrying(
    kind: str, mask: int, pairs: Pairs, axis: str
) -> Callable[[jax.Array], list[jax.Array]]:
    """A send branch: ``out`` over the permutes whose bit is set in ``mask``, zeros (no
    collective) for the others."""

    def run(out: jax.Array) -> list[jax.Array]:
        with jax.named_scope(BRANCH_SCOPE.format(SEND_BRANCH[kind] + mask)):
            return [jax.lax.ppermute(out, axis, p) if mask >> i & 1 else jnp.zeros_like(out)
                    for i, p in enumerate(pairs)]  # fmt: skip

    return run
