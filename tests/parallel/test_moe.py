"""Expert parallelism: the MoE block of ``examples/moe_block.py`` sharded over
data × expert × seq × model (and FSDP) equals the unsharded one-token-at-a-time reference
(``moe_ref``) — loss with its load-balance and z-losses, every gradient leaf including the
router's, one AdamW step — and drops exactly the assignments the reference drops, under both
dispatches (all-to-all and the ring of experts); its compiled step keeps the contract written
from the module's formulas, and the two silent bugs users hit (expert gradients summed over the
expert axis; synced over the wrong group) each break a test.

Routing flips are avoided honestly: every case's data is checked to have a margin between the
k-th and (k+1)-th scores (and, for the score drop order, between any two combine weights) far
above float32 rounding, so sharded and reference choose and drop the same assignments.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import moe_ref
import shardkit
from shardkit import ShardedModel, testing
from shardkit.comm import contract, ledger
from shardkit.parallel import moe
from shardkit.run import target

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("moe_block", ROOT / "examples" / "moe_block.py")
block = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(block)

E, D, F, B, T = block.E, block.D, block.F, block.B, block.T
W = 4  # float32 bytes
init, batch, sharded = block.init, block.batch, block.sharded


def full(shape: dict[str, int]) -> dict[str, int]:
    return {**dict.fromkeys(shardkit.AXES, 1), **shape}


def margins(p, h, cfg, grouping) -> float:
    """The smallest routing margin of the data: k-th vs (k+1)-th score, and for the score drop
    order the gap between any two combine weights of a group (but normalised top-1 weights,
    all exactly 1: the order is then the choice order on both sides)."""
    gaps = []
    for g in moe_ref.to_groups(h, grouping):
        logits = jnp.dot(g, p["moe"]["router"], precision=moe_ref.HIGHEST)
        scores = jax.nn.softmax(logits) if cfg.score == "softmax" else jax.nn.sigmoid(logits)
        top = -jnp.sort(-scores, axis=-1)
        if cfg.top_k < cfg.experts:
            gaps.append(float(jnp.min(top[:, cfg.top_k - 1] - top[:, cfg.top_k])))
        if cfg.order == "score" and not (cfg.top_k == 1 and cfg.normalize):  # (those are 1.0)
            _, w, _, _ = moe_ref.route(g, p["moe"]["router"], cfg)
            gaps.append(float(jnp.min(jnp.diff(jnp.sort(w.reshape(-1))))))
    return min(gaps)


def check(shape, cfg: moe.MoE, fsdp=False, dispatch_by="all_to_all") -> dict:
    """sharded == reference on ``shape``: loss, gradients, a step, the counts exactly."""
    mesh = shardkit.make_mesh(shape)
    params, (x, _) = init(), batch()
    h = jnp.einsum("btd,de->bte", x, params["proj"], precision=moe_ref.HIGHEST)
    grouping = block.groups(mesh)
    assert margins(params, h, cfg, grouping) > 1e-6, "the data is too close to a routing tie"
    comparison, got, want = block.verify(mesh, cfg, fsdp, dispatch_by)
    comparison.assert_ok()
    assert float(got["dropped"]) == float(want["dropped"])
    np.testing.assert_array_equal(got["tokens_per_expert"], want["tokens_per_expert"])
    return got


RING = "ring"
PLANS = [  # (mesh, MoE, fsdp, dispatch): every composition the issue names, drops, dropless
    ({"expert": 8}, moe.MoE(E, 2, 1.0), False, "all_to_all"),
    ({"data": 2, "expert": 4}, moe.MoE(E, 1, 1.0, order="score"), False, "all_to_all"),
    ({"data": 2, "expert": 2, "model": 2}, moe.MoE(E, 2, None), False, "all_to_all"),
    ({"data": 2, "expert": 4}, moe.MoE(E, 2, 0.5, aux="sequence"), True, "all_to_all"),
    ({"expert": 2, "seq": 4}, moe.MoE(E, 2, 1.25, score="sigmoid", normalize=True), False, RING),
    ({"expert": 4, "seq": 2}, moe.MoE(E, 1, 0.75, aux="sequence"), False, "all_to_all"),
    ({"expert": 2, "model": 4}, moe.MoE(E, 2, 1.0, order="score", normalize=True), False, RING),
    ({"data": 4, "expert": 2}, moe.MoE(E, 2, None, score="sigmoid"), True, "all_to_all"),
    ({"data": 2, "expert": 4}, moe.MoE(E, 2, 0.5), False, RING),
]


@pytest.mark.parametrize(("shape", "cfg", "fsdp", "dispatch_by"), PLANS)
def test_moe_plan_equals_reference(shape, cfg, fsdp, dispatch_by):
    got = check(shape, cfg, fsdp, dispatch_by)
    assert float(got["tokens_per_expert"].sum()) == B * T * cfg.top_k
    if cfg.capacity_factor is not None and cfg.capacity_factor < 1:
        assert float(got["dropped"]) > 0  # the case drops tokens, and the counts agreed


@st.composite
def cases(draw):
    """A mesh over 8 devices with an expert axis, and a routing rule."""
    shapes = [dict(zip(("data", "expert", "seq", "model"), s, strict=True))
              for s in testing.factorisations(8, 4)]  # fmt: skip
    fits = [s for s in shapes if s["expert"] > 1 and B % (s["data"] * s["expert"]) == 0
            and T % s["seq"] == 0 and F % s["model"] == 0]  # fmt: skip
    shape = draw(st.sampled_from(fits))
    cfg = moe.MoE(
        E,
        draw(st.sampled_from([1, 2])),
        draw(st.sampled_from([None, 0.5, 1.0, 1.25])),
        score=draw(st.sampled_from(moe.SCORES)),
        normalize=draw(st.booleans()),
        order=draw(st.sampled_from(moe.DROP_ORDERS)),
        aux=draw(st.sampled_from(moe.AUX_MODES)),
    )
    fsdp = draw(st.booleans()) and shape["data"] > 1
    return shape, cfg, fsdp, draw(st.sampled_from(moe.DISPATCHES))


@given(cases())
def test_moe_drawn_plans_equal_reference(case):
    check(*case)


# ----------------------------------------------------------------------------- contracts


def ring_terms(n_ep: int, n: int, k: int) -> list:
    """The ring of experts' collectives for n local tokens (``moe.ring_of_experts``)."""
    tokens, ints = n_ep * n * D * W, n_ep * n * 2 * k * 4
    return [
        contract.all_gather("expert", tokens, n_ep, 2, "tokens; the outputs' cotangent"),
        contract.all_gather("expert", n_ep * n * k * W, n_ep, 1, "combine weights"),
        contract.all_gather("expert", ints, n_ep, 1, "expert ids and slots (int32)"),
        contract.reduce_scatter("expert", tokens, n_ep, 2, "outputs; the tokens' cotangent"),
        contract.reduce_scatter("expert", n_ep * n * k * W, n_ep, 1, "the weights' cotangent"),
    ]


def expected(shape, cfg: moe.MoE, local_params: int, dispatch_by="all_to_all") -> list:
    """One clipped train step's collectives per device, from the formulas of ``parallel.moe``."""
    shape = full(shape)
    n_ep, n_tp = shape["expert"], shape["model"]
    token_axes = tuple(a for a in ("data", "expert", "seq") if shape[a] > 1)
    n_tokens = np.prod([shape[a] for a in token_axes])
    b, t = B // (shape["data"] * n_ep), T // shape["seq"]
    buffers = E * cfg.capacity(b * t) * D * W  # the local dispatch buffer [E, C, d]
    out = [contract.all_reduce(token_axes, (E + 1) * W, n_tokens, 1, "counts, dropped")]
    if dispatch_by == "ring":
        out += ring_terms(n_ep, b * t, cfg.top_k)
    else:
        out.append(contract.all_to_all("expert", buffers, n_ep, 4, "dispatch, combine ×2"))
    if n_tp > 1:
        per_expert = (E // n_ep) * cfg.capacity(b * t) * n_ep * D * W
        out.append(contract.all_reduce("model", per_expert, n_tp, 2, "expert down g, gate f"))
    expert_sync = tuple(a for a in ("data", "seq") if shape[a] > 1)
    expert_leaves = 3 * (E // n_ep) * D * (F // n_tp)
    if expert_sync:
        n = np.prod([shape[a] for a in expert_sync])
        out.append(contract.all_reduce(expert_sync, expert_leaves * W, n, 1, "expert grads"))
    rest = local_params - expert_leaves
    out.append(contract.all_reduce(token_axes, (rest + 1) * W, n_tokens, 1,
                                   "router, head grads + the loss"))  # fmt: skip
    axes = tuple(a for a in ("data", "expert", "seq", "model") if shape[a] > 1)
    out.append(contract.all_reduce(axes, W, int(np.prod([shape[a] for a in axes])), 1, "norm"))
    return out


def step_of(model: ShardedModel):
    optimizer = optax.adamw(1e-3)
    step = model.train_step(optimizer, clip_norm=1.0)
    p = model.shard(init())
    return step, p, model.init_opt_state(optimizer, p), model.shard_batch(*batch())


def local_param_count(model: ShardedModel) -> int:
    placed = model.shard(init())
    return sum(leaf.addressable_shards[0].data.size for leaf in jax.tree.leaves(placed))


CONTRACT_SHAPES = [{"expert": 8}, {"data": 2, "expert": 4}, {"data": 2, "expert": 2, "model": 2},
                   {"expert": 2, "seq": 4}]  # fmt: skip


@pytest.mark.parametrize("dispatch_by", moe.DISPATCHES)
@pytest.mark.parametrize("shape", CONTRACT_SHAPES)
def test_moe_step_keeps_its_contract(shape, dispatch_by):
    cfg = moe.MoE(E, 2, 1.0)
    model = sharded(shardkit.make_mesh(shape), cfg, dispatch_by=dispatch_by)
    step, p, state, xy = step_of(model)
    want = expected(shape, cfg, local_param_count(model), dispatch_by)
    contract.assert_contract(step, p, state, *xy, expected=want)


# ----------------------------------------------------------------------------- the silent bugs


class SyncedOver(ShardedModel):
    """A model whose expert gradients are synced over ``axes`` instead of data and seq."""

    wrong: tuple[str, ...] = ()

    def sync_grads_local(self, grads, share=None):
        axes = dict(self.sync_axes)
        axes["moe"] = {**axes["moe"], **dict.fromkeys(("gate", "up", "down"), self.wrong)}
        return self.riding(grads, axes, share)


def wrong_model(shape, wrong):
    cfg = moe.MoE(E, 2, 1.0)
    right = sharded(shardkit.make_mesh(shape), cfg)
    model = SyncedOver(right.mesh, block.PARAM_AXES, {"expert": "expert"}, right.loss_local,
                       batch_specs=right.batch_specs, token_axes=right.token_axes,
                       aux=True)  # fmt: skip
    model.wrong = wrong
    return model, cfg


def test_expert_grads_summed_over_expert_are_caught():
    """EP = 2: summing the expert weights' gradients over ``expert`` doubles them; the
    reference comparison names the leaf."""
    model, cfg = wrong_model({"expert": 2}, ("expert",))
    params, (x, y) = init(), batch()
    with pytest.raises(AssertionError, match=r"grads\['moe'\]\['(down|gate|up)'\]"):
        testing.compare_sharded(
            lambda p, x, y: (lambda o, g: (o["loss"], g))(*model.loss_and_grads(p, x, y)),
            lambda p, x, y: block.twin(p, x, y, cfg, (2, 1))[0],
            params,
            x,
            y,
            place=model.shard,
        ).assert_ok()


def test_expert_grads_synced_over_the_wrong_group_break_the_contract():
    """data=2 × expert=2: expert gradients all-reduced over data × expert (the group of the
    dense weights) are 2× and break the contract: their op joins the wrong group's."""
    shape = {"data": 2, "expert": 2}
    model, cfg = wrong_model(shape, ("data", "expert"))
    step, p, state, xy = step_of(model)
    want = expected(shape, cfg, local_param_count(model))
    with pytest.raises(AssertionError, match="contract broken"):
        contract.assert_contract(step, p, state, *xy, expected=want)


def test_expert_grads_not_synced_over_data_are_refused_at_trace_time():
    """Synced over expert instead of data: the gradients still differ over data, and
    shard_map's typing refuses the step, naming the expert leaves."""
    model, _ = wrong_model({"data": 2, "expert": 2}, ("expert",))
    step, p, state, xy = step_of(model)
    with pytest.raises(ValueError, match=r"\['moe'\]\['down'\].*varying over \{data,expert\}"):
        step(p, state, *xy)


def test_moe_config_errors_are_one_sentence():
    wrong = [({"top_k": 9}, "top_k"), ({"capacity_factor": 0}, "capacity_factor"),
             ({"score": "relu"}, "score"), ({"order": "random"}, "order")]  # fmt: skip
    for kwargs, needle in wrong:
        with pytest.raises(ValueError, match=needle):
            moe.MoE(E, **kwargs)


def test_capacity_rule():
    assert moe.MoE(8, 2, 1.0).capacity(64) == 16
    assert moe.MoE(8, 2, 1.25).capacity(64) == 20
    assert moe.MoE(8, 1, 0.01).capacity(64) == 1
    assert moe.MoE(8, 2, None).capacity(64) == 64
    assert dataclasses.replace(moe.MoE(8), capacity_factor=None).capacity(5) == 5


def test_plan_errors_name_the_expert_axis():
    """The ViT has no experts: an expert axis is a PlanError; aux metrics under a pipeline
    whose stages report none too; a dispatch that does not exist is a ValueError."""
    import vit_ref

    with pytest.raises(shardkit.PlanError, match="the ViT has no experts to split over expert=2"):
        shardkit.check_plan(vit_ref.variant("mu"), shardkit.Plan({"expert": 2}))
    mesh = shardkit.make_mesh({"stage": 2})
    stages = types.SimpleNamespace(metrics=None)  # a pipeline without a metrics function
    with pytest.raises(shardkit.PlanError, match="give aux=True exactly when its Stages have"):
        ShardedModel(mesh, {}, {}, pipeline=stages, aux=True)
    h, p = jnp.zeros((1, 4, D)), init()["moe"]
    with pytest.raises(ValueError, match="dispatch_by must be one of"):
        moe.moe_layer(h, p, moe.MoE(E), dispatch_by="ragged")


@pytest.mark.parametrize("shape", [{"data": 2, "expert": 4}, {"data": 2, "expert": 2, "model": 2}])
def test_ep_contract_holds_on_the_tpu_compiler(shape):
    """The MoE block's step compiled for a v5e:2x4 slice by the TPU compiler (libtpu, no
    chip): the all-to-all dispatch's contract exact there too, at full float32 precision. (At
    the default precision the compiler moves the dispatch all-to-all and its transpose in
    bf16, the dtype the expert matmuls read: 3/4 of the declared bytes, docs/strategies/moe.md.)"""
    devices = target.topology_devices("v5e:2x4").reshape(-1)
    mesh = shardkit.make_mesh(shape, devices=devices)
    cfg = moe.MoE(E, 2, 1.0)
    model = sharded(mesh, cfg)
    optimizer = optax.adamw(1e-3)
    shapes = jax.eval_shape(init)
    args = model.abstract_args(optimizer, shapes, *jax.eval_shape(batch))
    with testing.parity_precision():
        compiled = model.train_step(optimizer, clip_norm=1.0).lower(*args).compile()
    local = sum(int(np.prod(a.sharding.shard_shape(a.shape))) for a in jax.tree.leaves(args[0]))
    problems = contract.differences(ledger.ledger_of(compiled, mesh), expected(shape, cfg, local))
    assert not problems, problems
