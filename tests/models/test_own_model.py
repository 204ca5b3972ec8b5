"""A non-ViT model on the generic layer (``ShardedModel``), as the "shard your own model" page.

``examples/shard_own_model.py``'s encoder (ring attention over seq, TP over model, DP over
data) on meshes hypothesis draws from the model's own dims: one-call verification against its
plain-jnp twin and the user-written contract of its clipped train step. Then the generic
layer's own errors: each names the leaf, the dim, the axis, and the mistakes it exists to catch.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import jax
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import shardkit
from shardkit import PlanError, ShardedModel, testing
from shardkit.comm import contract

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "shard_own_model", ROOT / "examples" / "shard_own_model.py"
)
own = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(own)

LAYERS, D_IN = 2, 3


@st.composite
def cases(draw):
    heads, batch = draw(st.sampled_from([2, 4])), draw(st.sampled_from([2, 4]))
    tokens, mlp = draw(st.sampled_from([4, 6, 8])), draw(st.sampled_from([8, 12]))
    shape = draw(testing.meshes_dividing({"data": [batch], "seq": [tokens], "model": [heads, mlp]}))
    return shape, dict(batch=batch, tokens=tokens, dim=4 * heads, heads=heads, mlp=mlp)


def build(shape, d, rules=None, zero=3, accumulate=1):
    mesh = shardkit.make_mesh(shape)
    model = own.sharded_model(mesh)
    if rules is not None or accumulate > 1:
        model = ShardedModel(mesh, own.param_axes(LAYERS), rules or own.RULES, model.loss_local,
                             batch_specs=model.batch_specs, token_axes=("seq",),
                             zero=zero, accumulate=accumulate)  # fmt: skip
    params = own.init(0, D_IN, d["dim"], d["heads"], d["mlp"], LAYERS)
    return mesh, model, params, own.batch_of(1, d["batch"], d["tokens"], D_IN)


@given(cases())
def test_own_model_equals_twin_and_keeps_its_contract(case):
    shape, d = case
    with jax.numpy_rank_promotion("allow"):  # the user's code broadcasts biases like numpy
        mesh, model, params, (x, y) = build(shape, d)
        testing.compare_sharded(model.loss_and_grads, own.twin_loss, params, x, y,
                                place=model.shard).assert_ok()  # fmt: skip
        optimizer = optax.adamw(1e-3)
        step = model.train_step(optimizer, clip_norm=1.0)
        p = model.shard(params)
        local = own.local_param_count(model, params)
        want = own.expected_collectives(mesh, d["batch"], d["tokens"], d["dim"], d["heads"],
                                        LAYERS, local)  # fmt: skip
        if model.reduce_axes:
            want.append(contract.all_reduce(model.reduce_axes, 4, mesh.size, 1, "norm"))
        state = model.init_opt_state(optimizer, p)
        contract.assert_contract(step, p, state, *model.shard_batch(x, y), expected=want)


def test_fsdp_rule_gathers_for_the_user():
    """``"embed": "data"`` splits every embed dim over data; gather=True makes them whole."""
    shape, d = {"data": 2, "seq": 2, "model": 2}, dict(batch=4, tokens=4, dim=8, heads=2, mlp=8)
    with jax.numpy_rank_promotion("allow"):
        _, model, params, (x, y) = build(shape, d, {**own.RULES, "embed": "data"})
        assert model.specs["embed"]["kernel"] == P(None, "data")
        assert model.sync_axes["embed"]["kernel"] == ("seq",)  # reduce-scattered over data
        testing.compare_sharded(model.loss_and_grads, own.twin_loss, params, x, y,
                                place=model.shard).assert_ok()  # fmt: skip


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_levels_split_the_state_not_the_params(zero):
    """The same ``"embed": "data"`` rule at ZeRO-1/2: params stay whole, the optimizer state
    and the gradients are split, and two clipped AdamW steps equal plain DP's."""
    shape, d = {"data": 2, "seq": 2, "model": 2}, dict(batch=4, tokens=4, dim=8, heads=2, mlp=8)
    optimizer = testing.comparison_optimizer()  # AdamW, eps 1e-3: its docstring says why
    with jax.numpy_rank_promotion("allow"):
        _, model, params, (x, y) = build(shape, d, {**own.RULES, "embed": "data"}, zero=zero)
        _, plain, _, _ = build(shape, d)
        assert model.specs["embed"]["kernel"] == P()
        assert model.state_specs["embed"]["kernel"] == P(None, "data")
        stepped = []
        for m in (model, plain):
            p = m.shard(params)
            state = m.init_opt_state(optimizer, p)
            for _ in range(2):
                p, state, metrics = m.train_step(optimizer, clip_norm=0.1)(
                    p, state, *m.shard_batch(x, y)
                )
            stepped.append((p, metrics["grad_norm"], state))
        mu = stepped[0][2][0].mu["embed"]["kernel"]  # type: ignore[index]
        assert mu.sharding.spec == P(None, "data") and mu.addressable_shards[0].data.shape == (3, 4)
        testing.assert_trees_close(stepped[0][:2], stepped[1][:2], what=f"ZeRO-{zero} steps")


@pytest.mark.parametrize(("rules", "zero"), [(None, 3), ("fsdp", 3), ("fsdp", 2)])
def test_accumulated_micro_batches_equal_one_pass(rules, zero):
    """``accumulate=2``: the local batch as 2 micro-batches, one after another, averaged; the
    loss and every gradient equal the twin's on the whole batch (ring over seq, TP, DP; with
    FSDP's gathers and ZeRO-2's scatters once per micro-batch)."""
    shape, d = {"data": 2, "seq": 2, "model": 2}, dict(batch=8, tokens=4, dim=8, heads=2, mlp=8)
    rules = {**own.RULES, "embed": "data"} if rules == "fsdp" else None
    with jax.numpy_rank_promotion("allow"):
        _, model, params, (x, y) = build(shape, d, rules, zero=zero, accumulate=2)
        assert model.accumulate == 2
        testing.compare_sharded(model.loss_and_grads, own.twin_loss, params, x, y,
                                place=model.shard).assert_ok()  # fmt: skip
        text = jax.jit(model.loss_and_grads).lower(model.shard(params), *model.shard_batch(x, y))
        assert "while" in text.as_text()  # the micro-batch loop
        four = build(shape, d, rules, zero=zero, accumulate=4)[1]
        with pytest.raises(PlanError, match=r"local batch \(2\) is not divisible by accumul"):
            four.shard_batch(x[:4], y[:4])


def test_accumulate_is_refused_under_a_pipeline_or_below_one():
    mesh = shardkit.make_mesh({"data": 2})
    with pytest.raises(PlanError, match="accumulate must be a positive integer"):
        ShardedModel(mesh, {"w": ("embed",)}, {}, lambda p, x: x.sum(), accumulate=0)


def test_a_leaf_wrongly_token_free_is_an_implicit_collective():
    """Declaring the readout token-free (it is used on every token shard) makes check_vma
    reduce its gradient implicitly: the values stay right, the contract refuses it."""
    shape, d = {"data": 1, "seq": 2, "model": 1}, dict(batch=2, tokens=4, dim=8, heads=2, mlp=8)
    with jax.numpy_rank_promotion("allow"):
        mesh, model, params, (x, y) = build(shape, d)
        wrong = ShardedModel(mesh, own.param_axes(LAYERS), own.RULES, model.loss_local,
                             batch_specs=model.batch_specs, token_axes=("seq",),
                             token_free=("readout",))  # fmt: skip
        assert wrong.sync_axes["readout"]["kernel"] == ()
        testing.compare_sharded(wrong.loss_and_grads, own.twin_loss, params, x, y,
                                place=wrong.shard).assert_ok()  # fmt: skip
        with pytest.raises(AssertionError, match=r"implicit all-reduce over seq"):
            contract.assert_contract(wrong.loss_and_grads, wrong.shard(params), x, y,
                                     expected=[], mesh=mesh)  # fmt: skip


def test_errors_name_the_leaf_dim_and_axis():
    mesh = shardkit.make_mesh({"data": 2, "seq": 1, "model": 4})
    with jax.numpy_rank_promotion("allow"):
        params = own.init(0, D_IN, 6, 2, 8, LAYERS)  # 2 heads over model=4
        model = ShardedModel(mesh, own.param_axes(LAYERS), own.RULES, lambda p, x, y: 0.0)
        with pytest.raises(PlanError, match=r"^Param blocks/attn/key/bias dim 1 \(heads, "
                           r"size 2\) is not divisible by model=4\.$"):  # fmt: skip
            model.shard(params)
        with pytest.raises(PlanError, match=r"Batch input 0 dim 0 \(size 3\) is not divisible "
                           r"by data=2\."):  # fmt: skip
            model.check_inputs(jax.numpy.zeros((3, 4)))
        with pytest.raises(PlanError, match=r"Rule 'mlp' -> 'modle' names a mesh axis"):
            ShardedModel(mesh, own.param_axes(LAYERS), {"mlp": "modle"}, lambda p: 0.0)
        with pytest.raises(PlanError, match=r"Axis 'sequence' is not in the mesh"):
            ShardedModel(mesh, own.param_axes(LAYERS), {}, lambda p: 0.0,
                         token_axes=("sequence",))  # fmt: skip
        with pytest.raises(PlanError, match=r"grad_sync must be one of \('float32', 'bfloat16'\), "
                           r"got 'fp8'\."):  # fmt: skip
            ShardedModel(mesh, own.param_axes(LAYERS), {}, lambda p: 0.0, grad_sync="fp8")
        short = {"w": ("embed",)}
        with pytest.raises(PlanError, match=r"The params have 1 leaves but param_axes names 1"
                           r"|has 2 dims"):  # fmt: skip
            ShardedModel(mesh, short, {}, lambda p: 0.0).shard({"w": jax.numpy.zeros((2, 2))})


def test_a_batch_spec_that_splits_no_batch_axis_warns_once():
    """Leaving data out of a batch spec turns data parallelism off for that input, silently
    correct but n times the work: ShardedModel says so when it is built."""
    mesh = shardkit.make_mesh({"data": 2, "model": 4})
    axes = own.param_axes(LAYERS)
    with pytest.warns(UserWarning, match=r"batch_specs\[1\] = P\(\) splits no batch "
                      r"axis \(data\)") as record:  # fmt: skip
        ShardedModel(mesh, axes, own.RULES, lambda p, x, y: 0.0, batch_specs=(P("data"), P()))
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedModel(mesh, axes, own.RULES, lambda p, x, y: 0.0)  # the default splits dim 0


def test_mixed_precision_hands_the_forward_bf16_params_and_keeps_float32_state():
    """compute_dtype="bfloat16": loss_local sees bf16 params (but the kept prefixes), the
    gradients and the optimizer state stay float32, and the sharded model equals its twin
    given the same cast params within 1e-2: each bf16 param's gradient is rounded to bf16 (the
    cast's transpose) per device before the sum over data and seq, the twin's once (3.3e-3
    measured). The example mixes bf16 params with float32 inputs, which
    strict promotion (on in the tests) refuses: standard promotion here, as a user runs."""
    shape, d = {"data": 2, "seq": 2, "model": 2}, dict(batch=2, tokens=4, dim=8, heads=2, mlp=8)
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        mesh, base, params, (x, y) = build(shape, d)
        seen = {}

        def loss_local(p, *batch):
            seen.update({k: v.dtype for k, v in jax.tree_util.tree_leaves_with_path(p)})
            return base.loss_local(p, *batch)

        model = ShardedModel(mesh, own.param_axes(LAYERS), own.RULES, loss_local,
                             batch_specs=base.batch_specs, token_axes=("seq",),
                             compute_dtype="bfloat16",
                             keep_float32=("blocks/ln1", "blocks/ln2"))  # fmt: skip
        twin = lambda p, x, y: own.twin_loss(model.compute_params(p), x, y)  # noqa: E731
        testing.compare_sharded(model.loss_and_grads, twin, params, x, y,
                                place=model.shard, tol=1e-2).assert_ok()  # fmt: skip
        kept = {k: v for k, v in seen.items() if "'ln" in jax.tree_util.keystr(k)}
        assert kept and all(v == jax.numpy.float32 for v in kept.values())
        assert {v for k, v in seen.items() if k not in kept} == {jax.numpy.dtype("bfloat16")}
        _, grads = model.loss_and_grads(model.shard(params), *model.shard_batch(x, y))
        assert {g.dtype for g in jax.tree.leaves(grads)} == {jax.numpy.dtype("float32")}
