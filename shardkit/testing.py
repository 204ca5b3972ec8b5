"""Tools to verify a sharded model against its unsharded twin: tree comparison + strategies.

Comparison: the error of a leaf is its relative L2 error ``‖a − b‖ / max(‖b‖, floor)`` where
``floor = floor_fraction · max over leaves of ‖b_leaf‖``. The floor matters for leaves whose
true value is (near) zero, such as the key-projection bias gradient (softmax is invariant to a
per-query constant, so it is exactly zero analytically and float noise in both runs): without
it their "relative" error is noise over noise. A wrong leaf of ordinary size still shows an
error of order 1.

One call: ``compare_sharded(sharded, twin, params, *batch)`` compares the loss, every gradient
leaf and one optimizer step (``comparison_optimizer``: AdamW with eps 1e-3, and why) of any
sharded function against its unsharded twin, and names the worst leaf.

Strategies (hypothesis) draw valid combinations: meshes as factorisations of 1..8 devices
(3 and 6 included, axes of size 1 included) — for any model with ``meshes_dividing`` (your
dims, your axes) — and, for the ViT, configs small enough for CPU and plans whose every
divisibility constraint holds, so failures are real.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from hypothesis import strategies as st

import vit_ref
from shardkit.mesh import AXES, ZERO_LEVELS, Plan, to_host
from shardkit.parallel.data import optax_update
from shardkit.parallel.schedules import SCHEDULES

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


@st.composite
def vit_configs(
    draw: st.DrawFn, heads_multiple: int = 1, mlp_multiple: int = 1, dim_multiple: int = 1
) -> vit_ref.ViTConfig:
    """A small random ViT (depth ≥ 2, both pools, both posembs, random head) for CPU tests.

    Images hold 1 to 16 patches: tiny ones give fewer tokens than a sequence-parallel axis has
    devices (blocks of pure padding), larger ones token counts that do not divide.
    """
    heads = heads_multiple * draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([4, 8]))
    dim = math.lcm(heads * head_dim, dim_multiple, 4)
    dim *= -(-8 // dim)  # sincos2d needs dim ≥ 8; a multiple keeps every divisibility
    patch = draw(st.sampled_from([2, 4]))
    grid = draw(st.integers(1, 4))
    return vit_ref.ViTConfig(
        image=patch * grid,
        patch=patch,
        channels=draw(st.sampled_from([1, 3])),
        classes=draw(st.integers(2, 7)),
        dim=dim,
        depth=draw(st.integers(2, 3)),
        heads=heads,
        mlp_dim=mlp_multiple * 4 * draw(st.integers(1, 3)),
        pool=draw(st.sampled_from(["tok", "gap"])),
        posemb=draw(st.sampled_from(["learn", "sincos2d"])),
        head_zeroinit=False,
    )


SEQ_MODES = ("ring", "ulysses", "usp")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def sharded_cases(
    draw: st.DrawFn,
    max_devices: int = 8,
    sp_modes: tuple[str, ...] = ("none",),
    zero: int | None = None,
    remat: bool | None = None,
) -> tuple[vit_ref.ViTConfig, Plan, int]:
    """(cfg, plan, batch) that fit each other: every divisibility constraint holds.

    ``zero`` (the ZeRO level, 3 = FSDP; any level needs data > 1) / ``remat``: None draws
    them. For ``usp`` the Ulysses degree u is drawn among the
    divisors of the seq size (heads per model shard then divide by u) and given explicitly or
    left to the automatic choice, so true hybrids (1 < u < seq) occur, not only the pure ends.
    ``megatron`` draws a seq axis too (tokens over seq × model), with its inner core a ring
    or, given u explicitly, Ulysses / USP.
    """
    sp = draw(st.sampled_from(sp_modes))
    axes = ("data", "model") if sp == "none" else DEFAULT_AXES
    mesh = draw(meshes(max_devices, axes))
    # A mode whose axis drew size 1 degenerates to plain TP/DP (still a valid, useful case).
    if (sp == "megatron" and mesh["model"] == 1) or (sp in SEQ_MODES and mesh["seq"] == 1):
        sp = "ring" if sp == "megatron" and mesh["seq"] > 1 else "none"
    if zero is None:
        zero = draw(st.sampled_from(ZERO_LEVELS)) if mesh["data"] > 1 else 0
    use_remat = draw(st.booleans()) if remat is None else remat
    ulysses = {"ulysses": mesh["seq"]}.get(sp, 1)
    explicit_ulysses = None
    if sp == "usp" or (sp == "megatron" and mesh["seq"] > 1):
        # Megatron-SP over seq: a ring inside attention unless a Ulysses degree is given.
        ulysses = draw(st.sampled_from(_divisors(mesh["seq"])))
        explicit_ulysses = draw(st.sampled_from([None, ulysses]))
        if sp == "megatron" and explicit_ulysses is None:
            ulysses = 1
    heads_multiple = mesh["model"] * ulysses
    cfg = draw(vit_configs(heads_multiple, mesh["model"], mesh["data"] if zero else 1))
    batch = mesh["data"] * draw(st.integers(1, 2))
    plan = Plan(mesh, sp=sp, ulysses=explicit_ulysses, zero=zero, remat=use_remat)
    return cfg, plan, batch


@st.composite
def pipeline_cases(
    draw: st.DrawFn, max_devices: int = 8, schedules: Sequence[str] = SCHEDULES
) -> tuple[vit_ref.ViTConfig, Plan, int]:
    """(cfg, plan, batch) of a pipelined ViT: a schedule over stage = 2..max_devices, composed
    with whatever data, seq and model the remaining devices allow, ZeRO 0, 1 or 3 (FSDP).

    M is drawn as the schedule allows: any 1..2S for GPipe and 1F1B (multiples of S or not),
    a multiple of S for interleaved (V = 1 or 2), S..2S for zb. Tokens over seq run Ulysses
    (a ring cannot run inside a schedule branch, ``parallel.pipeline``); with model > 1 the
    mode may be Megatron-SP (a Ulysses core over seq). One layer per chunk: depth = S·V.
    """
    pp = draw(st.sampled_from(list(schedules)))
    stages = draw(st.integers(2, max_devices))
    mesh = {**draw(meshes(max_devices // stages)), "stage": stages}
    seq, model = mesh["seq"], mesh["model"]
    virtual = draw(st.integers(1, 2)) if pp == "interleaved" else 1
    if pp == "interleaved":
        micro = stages * draw(st.integers(1, 2))
    elif pp == "zb":
        micro = draw(st.integers(stages, 2 * stages))
    else:
        micro = draw(st.integers(1, 2 * stages))
    sp = "ulysses" if seq > 1 else "none"
    if model > 1 and draw(st.booleans()):
        sp = "megatron"
    zero = draw(st.sampled_from((0, 1, 3))) if mesh["data"] > 1 else 0  # ZeRO-2: refused
    cfg = draw(vit_configs(model * seq, model, mesh["data"] if zero else 1))
    cfg = dataclasses.replace(cfg, depth=stages * virtual)
    plan = Plan(
        mesh,
        sp=sp,
        ulysses=seq if sp == "megatron" and seq > 1 else None,
        zero=zero,
        pp=pp,
        microbatches=micro,
        virtual=virtual,
    )
    return cfg, plan, mesh["data"] * micro
