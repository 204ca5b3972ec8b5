"""Tools to verify a sharded model against its unsharded twin: tree comparison + strategies.

Comparison: the error of a leaf is its relative L2 error ``‖a − b‖ / max(‖b‖, floor)`` where
``floor = floor_fraction · max over leaves of ‖b_leaf‖``. The floor matters for leaves whose
true value is (near) zero, such as the key-projection bias gradient (softmax is invariant to a
per-query constant, so it is exactly zero analytically and float noise in both runs): without
it their "relative" error is noise over noise. A wrong leaf of ordinary size still shows an
error of order 1.

Precision: on TPU (and GPU) a float32 matmul at JAX's default precision is a bf16 pass (about
3 digits), so two correct float32 programs differ by ~5e-3. Every comparison here runs both
sides under ``parity_precision()`` (``jax.default_matmul_precision("highest")``: float32
matmuls in full float32, the CPU's default anyway), so the 1e-5 bound means the same on every
backend. A step jitted before the call keeps the precision it was traced with.

One call: ``compare_sharded(sharded, twin, params, *batch)`` compares the loss, every gradient
leaf and one optimizer step (``comparison_optimizer``: AdamW with eps 1e-3, and why) of any
sharded function against its unsharded twin, and names the worst leaf.

Strategies (hypothesis) draw valid combinations: meshes as factorisations of 1..8 devices
(3 and 6 included, axes of size 1 included) — for any model with ``meshes_dividing`` (your
dims, your axes). Model-free: the ViT's own strategies (configs and plans whose every
divisibility constraint holds) are ``shardkit.models.vit.strategies``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from hypothesis import strategies as st

from shardkit.mesh import AXES, to_host
from shardkit.parallel.data import optax_update

PyTree = Any
# The axes drawn by default: every axis but the pipeline's ``stage`` (``pipeline_cases`` draws
# it, with a schedule).
DEFAULT_AXES = ("data", "seq", "model")
DEFAULT_FLOOR = 1e-2


def _norm(x: Any) -> float:
    return float(np.linalg.norm(np.asarray(x, dtype=np.float64).ravel()))


def tree_errors(actual: PyTree, expected: PyTree, floor: float = DEFAULT_FLOOR) -> dict[str, float]:
    """Relative L2 error of every leaf, keyed by its path (e.g. ``['blocks']['mlp']...``).

    Leaves spread over several processes are gathered first (``to_host``): in a multi-process
    run every process calls this and gets the same errors."""
    actual, expected = to_host(actual), to_host(expected)
    exp_leaves = jax.tree_util.tree_leaves_with_path(expected)
    act_leaves = jax.tree.leaves(actual)
    if len(act_leaves) != len(exp_leaves):
        raise ValueError(f"Trees differ: {len(act_leaves)} leaves vs {len(exp_leaves)} expected.")
    scale = floor * max((_norm(leaf) for _, leaf in exp_leaves), default=0.0)
    errors = {}
    for (path, b), a in zip(exp_leaves, act_leaves, strict=True):
        if np.shape(a) != np.shape(b):
            raise ValueError(
                f"Leaf {jax.tree_util.keystr(path)}: shape {np.shape(a)} vs {np.shape(b)}."
            )
        diff = np.asarray(a, np.float64) - np.asarray(b, np.float64)
        errors[jax.tree_util.keystr(path)] = _norm(diff) / max(_norm(b), scale, 1e-30)
    return errors


def worst_leaf(errors: dict[str, float]) -> tuple[str, float]:
    """(path, error) of the largest error (("", 0.0) for an empty tree)."""
    return max(errors.items(), key=lambda kv: kv[1], default=("", 0.0))


def max_error(actual: PyTree, expected: PyTree, floor: float = DEFAULT_FLOOR) -> float:
    return worst_leaf(tree_errors(actual, expected, floor))[1]


def assert_trees_close(
    actual: PyTree,
    expected: PyTree,
    tol: float = 1e-5,
    floor: float = DEFAULT_FLOOR,
    what: str = "",
) -> None:
    """AssertionError naming the worst leaf if any leaf's relative error exceeds ``tol``."""
    path, err = worst_leaf(tree_errors(actual, expected, floor))
    if err > tol:
        raise AssertionError(
            f"{what or 'trees'}: leaf {path} has relative error {err:.3g} > {tol:g}."
        )


# ----------------------------------------------------------------------------- one call


def comparison_optimizer() -> optax.GradientTransformation:
    """AdamW with eps = 1e-3 (not optax's 1e-8), the optimizer ``compare_sharded`` steps with.

    Some gradients are analytically zero (an attention key bias: softmax ignores a per-query
    constant), so both runs hold only float32 rounding noise there, and Adam's first step,
    lr · g / (|g| + eps), turns that noise into updates of up to ±lr that differ between any two
    correct implementations. With eps = 1e-3 the noise moves those params by ~lr · 1e-5, while
    real gradients still take at least half an Adam step, so a wrong or missing update remains
    an error of order 1e-2 (measured on a ViT: step error 1.1e-6 with eps 1e-3, 1.1e-5 with
    1e-4; see ``shardkit.run.verify``).
    """
    return optax.adamw(1e-3, eps=1e-3, weight_decay=1e-4)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Per-leaf relative errors of a sharded function against its unsharded twin.

    Attributes:
      loss: the loss's relative error.
      grads: every gradient leaf's error, keyed by path.
      step: every param leaf's error after one ``comparison_optimizer`` step.
      tol: the bound all of them must meet.
    """

    loss: float
    grads: dict[str, float]
    step: dict[str, float]
    tol: float

    @property
    def worst(self) -> tuple[str, float]:
        """(what, error) of the largest error, e.g. ``("grads['fc1']['kernel']", 3e-7)``."""
        named = {"loss": self.loss}
        named |= {f"grads{k}": v for k, v in self.grads.items()}
        named |= {f"step{k}": v for k, v in self.step.items()}
        return worst_leaf(named)

    @property
    def ok(self) -> bool:
        return self.worst[1] <= self.tol

    def assert_ok(self) -> None:
        """AssertionError naming the worst leaf if any error exceeds ``tol``."""
        what, err = self.worst
        if err > self.tol:
            raise AssertionError(
                f"sharded != twin: {what} has relative error {err:.3g} > {self.tol:g}."
            )


def parity_precision() -> Any:
    """The context in which sharded and reference are compared: float32 matmuls at full
    float32 precision on every backend (the module docstring says why)."""
    return jax.default_matmul_precision("highest")


def compare_sharded(
    sharded: Callable[..., tuple[Any, PyTree]],
    twin: Callable[..., Any],
    params: PyTree,
    *batch: Any,
    place: Callable[[PyTree], PyTree] = lambda p: p,
    optimizer: optax.GradientTransformation | None = None,
    tol: float = 1e-5,
    floor: float = DEFAULT_FLOOR,
) -> Comparison:
    """One call: a sharded ``(params, *batch) -> (loss, grads)`` against its unsharded twin.

    Compares the loss, every gradient leaf, and the params after one optimizer step taken from
    each side's gradients (``comparison_optimizer`` by default: read its docstring before
    choosing another). Errors are per-leaf relative L2 with the ``floor`` of ``tree_errors``.

    Args:
      sharded: e.g. a jitted ``shard_map`` returning the loss and gradients shaped like params.
      twin: the unsharded loss, ``twin(params, *batch) -> loss``.
      params: the unsharded params (random, non-degenerate: a zero layer makes it vacuous).
      *batch: the inputs, passed to both.
      place: puts ``params`` on the mesh for ``sharded`` (e.g. ``device_put`` per spec).
      optimizer: the step both sides take.
      tol: fp32 bound 1e-5; loosen it (and say why) for bf16.
      floor: see ``tree_errors``.

    Returns:
      A :class:`Comparison`; call ``.assert_ok()`` in a test.
    """
    with parity_precision():
        want_loss, want_grads = jax.value_and_grad(twin)(params, *batch)
        loss, grads = sharded(place(params), *batch)
    grads = jax.device_get(grads)
    optimizer = optimizer or comparison_optimizer()
    state = optimizer.init(params)
    stepped = [optax_update(optimizer, g, state, params)[0] for g in (grads, want_grads)]
    return Comparison(
        loss=max_error(loss, want_loss, floor),
        grads=tree_errors(grads, want_grads, floor),
        step=tree_errors(stepped[0], stepped[1], floor),
        tol=tol,
    )


# ----------------------------------------------------------------------------- strategies


def factorisations(n: int, k: int = 3) -> list[tuple[int, ...]]:
    """All ordered k-tuples of positive integers whose product is n."""
    if k == 1:
        return [(n,)]
    return [
        (d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in factorisations(n // d, k - 1)
    ]


@st.composite
def meshes(
    draw: st.DrawFn, max_devices: int = 8, axes: tuple[str, ...] = DEFAULT_AXES
) -> dict[str, int]:
    """A mesh shape over 1..max_devices devices using only ``axes`` (others are 1)."""
    n = draw(st.integers(1, max_devices))
    sizes = draw(st.sampled_from(factorisations(n, len(axes))))
    return {**dict.fromkeys(AXES, 1), **dict(zip(axes, sizes, strict=True))}


@st.composite
def meshes_dividing(
    draw: st.DrawFn, dims: Mapping[str, Sequence[int]], max_devices: int = 8
) -> dict[str, int]:
    """A mesh over 1..max_devices devices whose every axis size divides the dims it splits.

    ``dims`` maps an axis to the sizes it must divide, e.g. ``{"data": [batch], "model":
    [heads, mlp_hidden], "seq": [tokens]}`` for your own model; axes not named stay 1. Works
    for any model: the constraints are yours, not a ViT's.
    """
    axes = tuple(a for a in AXES if a in dims)
    unknown = sorted(set(dims) - set(AXES))
    if unknown:
        raise ValueError(f"Unknown mesh axis {unknown[0]!r}; axes are {', '.join(AXES)}.")
    choices = [
        shape
        for n in range(1, max_devices + 1)
        for shape in factorisations(n, len(axes))
        if all(d % size == 0 for axis, size in zip(axes, shape, strict=True) for d in dims[axis])
    ]
    sizes = draw(st.sampled_from(choices))
    return {**dict.fromkeys(AXES, 1), **dict(zip(axes, sizes, strict=True))}
