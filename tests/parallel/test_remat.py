"""``parallel.remat``: a plan-level remat for a user's blocks.

A model marks its blocks once with ``remat.block``; ``ShardedModel(remat=...)`` decides what
their backward recomputes. Held here on the GPT (4 layers, data × model): every policy gives
the same loss and gradients; "full" keeps less temp memory than "none" (``memory_analysis``,
deterministic); the policy is in force only while the model's loss is traced; a bad policy is
one sentence."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import shardkit
from shardkit.mesh import PlanError
from shardkit.models import gpt
from shardkit.models.sharded import ShardedModel
from shardkit.parallel import remat

CFG = dataclasses.replace(gpt.GPTConfig(), layers=4)
SHAPE = {"data": 4, "model": 2}


def run(policy):
    """(loss, grads, temp bytes) of the GPT's loss_and_grads under ``policy``."""
    plan = gpt.GPTPlan(SHAPE, remat=policy)
    model = gpt.sharded_gpt(shardkit.make_mesh(SHAPE), CFG, plan)
    params = model.shard(gpt.init(0, CFG))
    x, y = model.shard_batch(*gpt.windows(np.random.default_rng(0), 8, CFG.tokens))
    temp = model.loss_and_grads.lower(params, x, y).compile().memory_analysis().temp_size_in_bytes
    loss, grads = model.loss_and_grads(params, x, y)
    return loss, jax.device_get(grads), temp


@pytest.fixture(scope="module")
def runs():
    return {policy: run(policy) for policy in remat.POLICIES}


@pytest.mark.parametrize("policy", ["dots", "full"])
def test_every_policy_computes_the_same_gradients(runs, policy):
    loss, grads, _ = runs[policy]
    want_loss, want, _ = runs["none"]
    assert float(loss) == pytest.approx(float(want_loss), abs=1e-6)
    errors = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), grads, want)
    assert max(jax.tree.leaves(errors)) <= 1e-6, errors


def test_full_remat_keeps_less(runs):
    assert runs["full"][2] < runs["none"][2]


def test_the_policy_holds_only_while_the_loss_is_traced():
    seen = []

    def loss_local(p, x):
        seen.append(remat.current())
        return (x @ p["w"]).sum()

    mesh = shardkit.make_mesh({"data": 8})
    model = ShardedModel(mesh, {"w": ("embed",)}, {}, loss_local, remat="full")
    model.loss_and_grads(model.shard({"w": np.ones(4, np.float32)}), np.ones((8, 4), np.float32))
    assert seen == ["full"] and remat.current() == "none"


def test_a_bad_policy_is_one_sentence():
    mesh = shardkit.make_mesh({"data": 8})
    with pytest.raises(PlanError, match="Unknown remat policy 'some'; choose none, dots, full"):
        ShardedModel(mesh, {"w": ("embed",)}, {}, lambda p, x: x.sum(), remat="some")
    with pytest.raises(PlanError, match="remat must be one of none, dots, full"):
        gpt.check_plan(CFG, gpt.GPTPlan(SHAPE, remat="most"), 8)
