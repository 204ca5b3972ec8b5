"""shardkit.testing: the tree comparison names the worst leaf, and the strategies draw only plans
that can run (every divisibility constraint holds), while still reaching the hard cases.

No compilation here: the strategies are checked by ``check_plan`` and ``make_layout`` (mesh and
token split), which is what ``ShardedViT`` does before it traces anything.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

import vit_ref
from shardkit.mesh import AXES, Plan
from shardkit.models.vit import check_plan, make_layout
from shardkit.models.vit.strategies import sharded_cases, vit_configs
from shardkit.testing import (
    assert_trees_close,
    factorisations,
    max_error,
    meshes,
    meshes_dividing,
    tree_errors,
    worst_leaf,
)

SEQ_MODES = ("megatron", "ring", "ulysses", "usp")
# Pure Python draws: many more than the ci profile's count cost well under a second each.
MANY = settings(max_examples=150)
# Any example will do: skip shrinking. The rarest case (Megatron-SP over seq × model with
# Ulysses inside) is about 1 draw in 200, and the ci profile's derandomized stream shifts with
# every new draw in the strategies (2,000 missed it once): the search stops at the first hit.
FIND = settings(max_examples=10_000, database=None, phases=[Phase.generate])


def tree(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "a": {"kernel": rng.standard_normal((4, 3)), "bias": rng.standard_normal(3)},
        "b": rng.standard_normal((5,)),
    }


# ----------------------------------------------------------------------------- comparison


def test_identical_trees_have_zero_error() -> None:
    expected = tree()
    assert set(tree_errors(expected, expected)) == {"['a']['bias']", "['a']['kernel']", "['b']"}
    assert max_error(expected, expected) == 0.0
    assert_trees_close(expected, expected, tol=0.0)


def test_wrong_leaf_is_detected_and_named() -> None:
    expected, actual = tree(), tree()
    actual["a"]["kernel"] = actual["a"]["kernel"] * 1.01  # 1% off: relative error 1e-2
    errors = tree_errors(actual, expected)
    np.testing.assert_allclose(errors["['a']['kernel']"], 1e-2, rtol=1e-9)
    assert errors["['a']['bias']"] == errors["['b']"] == 0.0
    assert worst_leaf(errors) == ("['a']['kernel']", errors["['a']['kernel']"])
    with pytest.raises(AssertionError, match=r"grads: leaf \['a'\]\['kernel'\] has relative error"):
        assert_trees_close(actual, expected, tol=1e-5, what="grads")
    assert_trees_close(actual, expected, tol=2e-2)


def test_worst_of_several_wrong_leaves_is_named() -> None:
    expected, actual = tree(), tree()
    actual["b"] = actual["b"] + 1e-3 * np.linalg.norm(actual["b"])
    actual["a"]["bias"] = -actual["a"]["bias"]  # relative error 2: the worst
    assert worst_leaf(tree_errors(actual, expected))[0] == "['a']['bias']"
    with pytest.raises(AssertionError, match=r"leaf \['a'\]\['bias'\] has relative error 2 "):
        assert_trees_close(actual, expected)


def test_floor_is_a_fraction_of_the_largest_leaf() -> None:
    """A leaf that is analytically zero compares its noise against floor · max leaf norm."""
    big = np.full((100,), 1.0)  # norm 10
    expected = {"big": big, "zero": np.full((4,), 1e-9)}
    actual = {"big": big, "zero": np.full((4,), -1e-9)}  # noise vs noise: 200% "relative"
    diff = np.linalg.norm(np.full((4,), 2e-9))
    errors = tree_errors(actual, expected)  # default floor 1e-2: divide by 1e-2 · 10
    np.testing.assert_allclose(errors["['zero']"], diff / 0.1, rtol=1e-9)
    np.testing.assert_allclose(
        tree_errors(actual, expected, floor=0.5)["['zero']"], diff / 5.0, rtol=1e-9
    )
    # Without a floor the noise leaf's own norm is the scale: error 2.
    np.testing.assert_allclose(tree_errors(actual, expected, floor=0.0)["['zero']"], 2.0)
    with pytest.raises(AssertionError, match=r"\['zero'\]"):
        assert_trees_close(actual, expected, floor=0.0)
    assert_trees_close(actual, expected)  # ... but 4e-7 with the default floor
    # A leaf above the floor is compared with its own norm, whatever the floor.
    expected["zero"], actual["zero"] = np.full((4,), 1.0), np.full((4,), 1.1)
    np.testing.assert_allclose(tree_errors(actual, expected)["['zero']"], 0.1, rtol=1e-9)


def test_comparison_accepts_jax_arrays_and_bfloat16() -> None:
    expected = {"x": jnp.arange(4.0)}
    actual = {"x": jnp.arange(4.0).astype(jnp.bfloat16)}
    assert max_error(actual, expected) == 0.0  # small integers are exact in bf16


def test_structure_mismatches_raise() -> None:
    with pytest.raises(ValueError, match="3 leaves vs 2 expected"):
        tree_errors(tree(), {"a": 1.0, "b": 2.0})
    wrong = tree()
    wrong["b"] = wrong["b"][:4]
    with pytest.raises(ValueError, match=r"Leaf \['b'\]: shape \(4,\) vs \(5,\)"):
        tree_errors(wrong, tree())
    assert worst_leaf({}) == ("", 0.0)


# ----------------------------------------------------------------------------- strategies


@pytest.mark.parametrize("k", [1, 2, 3])
def test_factorisations_are_all_ordered_tuples(k: int) -> None:
    for n in range(1, 9):
        found = factorisations(n, k)
        assert len(found) == len(set(found))
        assert all(len(f) == k and math.prod(f) == n for f in found)
        brute = {
            f for f in np.ndindex(*(n + 1,) * k) if all(d >= 1 for d in f) and math.prod(f) == n
        }
        assert set(found) == brute


@MANY
@given(mesh=meshes(8, ("data", "model")))
def test_meshes_use_only_the_given_axes(mesh: dict[str, int]) -> None:
    assert tuple(mesh) == AXES and mesh["seq"] == 1
    assert 1 <= math.prod(mesh.values()) <= 8


@MANY
@given(cfg=vit_configs(heads_multiple=3, mlp_multiple=2, dim_multiple=5))
def test_vit_configs_are_small_valid_and_divisible(cfg: vit_ref.ViTConfig) -> None:
    assert cfg.heads % 3 == 0 and cfg.mlp_dim % 2 == 0 and cfg.dim % 5 == 0
    assert cfg.depth >= 2 and not cfg.head_zeroinit
    assert 1 <= cfg.num_patches <= 16


@MANY
@given(case=sharded_cases(max_devices=8, sp_modes=("none", *SEQ_MODES)))
def test_sharded_cases_pass_check_plan(case: tuple[vit_ref.ViTConfig, Plan, int]) -> None:
    cfg, plan, batch = case
    check_plan(cfg, plan, batch)
    layout = make_layout(cfg, plan)  # builds the mesh (USP: the split one) and the token split
    assert layout.padded_tokens % layout.token_shards == 0
    assert 1 <= plan.num_devices <= 8


def test_sharded_cases_reach_the_hard_cases() -> None:
    """Each property below is drawn by the strategies (``find`` raises if none is)."""
    all_modes = sharded_cases(max_devices=8, sp_modes=SEQ_MODES)
    dp_tp = sharded_cases(max_devices=8)

    def layout(case: tuple) -> object:
        return make_layout(case[0], case[1])

    wanted = {
        "3 devices": (dp_tp, lambda c: c[1].num_devices == 3),
        "6 devices, both axes": (
            dp_tp,
            lambda c: c[1].num_devices == 6 and c[1].size("data") > 1 and c[1].size("model") > 1,
        ),
        "fsdp over 3": (dp_tp, lambda c: c[1].fsdp and c[1].size("data") == 3),
        "gap + sincos2d": (dp_tp, lambda c: c[0].pool == "gap" and c[0].posemb == "sincos2d"),
        "tok + learn": (dp_tp, lambda c: c[0].pool == "tok" and c[0].posemb == "learn"),
        "layers unrolled": (dp_tp, lambda c: c[1].layers == "unrolled"),
        "3-D mesh": (all_modes, lambda c: min(c[1].size(a) for a in ("data", "seq", "model")) > 1),
        "fewer tokens than seq devices": (
            all_modes,
            lambda c: c[1].sp in ("ring", "ulysses") and c[0].num_tokens < c[1].size("seq"),
        ),
        "tokens not divisible": (
            all_modes,
            lambda c: c[1].sp != "none" and layout(c).padded,  # type: ignore[attr-defined]
        ),
        "true USP hybrid": (
            all_modes,
            lambda c: c[1].sp == "usp" and layout(c).attention == "usp",  # type: ignore[attr-defined]
        ),
        "megatron with remat": (all_modes, lambda c: c[1].sp == "megatron" and c[1].recompute),
        "megatron over seq × model, ring inside": (
            all_modes,
            lambda c: c[1].sp == "megatron" and layout(c).attention == "ring",  # type: ignore[attr-defined]
        ),
        "megatron over seq × model, Ulysses or USP inside": (
            all_modes,
            lambda c: c[1].sp == "megatron" and layout(c).attention in ("ulysses", "usp"),  # type: ignore[attr-defined]
        ),
    }
    for name, (strategy, condition) in wanted.items():
        found = find(strategy, condition, settings=FIND)
        assert condition(found), name


# ----------------------------------------------------------------------------- compare_sharded


def _twin(p, x):
    return jnp.sum(jnp.tanh(x @ p["w"] + p["b"][None]) ** 2) / x.shape[0]


def _dp(scale: float = 1.0):
    """A DP loss-and-grads on data=4 (``scale`` != 1 plants a bug in the gradients)."""
    from jax.sharding import PartitionSpec as P

    from shardkit import data as dp
    from shardkit.mesh import make_mesh

    axes = {"w": ("data",), "b": ("data",)}

    def body(p, x):
        def loss(p):
            return jnp.sum(jnp.tanh(x @ p["w"] + p["b"][None]) ** 2) / (4 * x.shape[0])

        value, grads = jax.value_and_grad(loss)(dp.vary(p, axes))
        grads = jax.tree.map(lambda g: g * scale, dp.sync_grads(grads, axes))
        return jax.lax.psum(value, "data"), grads

    mesh = make_mesh({"data": 4})
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())))


def _params():
    rng = np.random.default_rng(0)
    p = {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=2)}
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p), jnp.asarray(
        rng.normal(size=(8, 3)), jnp.float32
    )


def test_compare_sharded_passes_a_correct_function_and_names_a_wrong_leaf() -> None:
    from shardkit.testing import compare_sharded

    params, x = _params()
    good = compare_sharded(_dp(), _twin, params, x)
    assert good.ok and good.worst[1] <= 1e-6 and set(good.grads) == {"['b']", "['w']"}
    good.assert_ok()
    bad = compare_sharded(_dp(scale=4.0), _twin, params, x)  # gradients 4x too large
    assert not bad.ok and bad.grads["['w']"] == pytest.approx(3.0, rel=1e-5)
    with pytest.raises(AssertionError, match=r"sharded != twin: grads\['.'\] has relative error"):
        bad.assert_ok()


def test_comparison_optimizer_keeps_rounding_noise_small() -> None:
    """A leaf whose true gradient is 0: noise of 1e-9 on one side. Adam with eps 1e-8 turns it
    into a step of ~lr/11 (a visible step error); eps 1e-3 keeps it ~lr·1e-6."""
    import optax

    from shardkit.testing import compare_sharded

    params, x = _params()
    params = {**params, "z": jnp.ones(4, jnp.float32)}  # the loss ignores z: gradient exactly 0

    def twin(p, x):
        return _twin(p, x) + 0.0 * jnp.sum(p["z"])

    def noisy(p, x):
        loss, grads = jax.value_and_grad(twin)(p, x)
        return loss, {**grads, "z": jnp.full(4, 1e-9, jnp.float32)}

    standard = compare_sharded(noisy, twin, params, x, optimizer=optax.adamw(1e-3))
    chosen = compare_sharded(noisy, twin, params, x)
    assert standard.step["['z']"] > 1e-5 > 1e-6 > chosen.step["['z']"]
    assert chosen.ok and not standard.ok


@given(
    st.integers(1, 12).flatmap(
        lambda batch: st.tuples(st.just(batch), meshes_dividing({"data": [batch], "model": [6]}))
    )
)
def test_meshes_dividing_only_draws_meshes_that_divide(case) -> None:
    batch, mesh = case
    assert batch % mesh["data"] == 0 and 6 % mesh["model"] == 0 and mesh["seq"] == 1
    assert math.prod(mesh.values()) <= 8


def test_meshes_dividing_rejects_unknown_axes() -> None:
    with pytest.raises(ValueError, match="Unknown mesh axis 'pipe'"):
        find(meshes_dividing({"pipe": [2]}), lambda _: True)
