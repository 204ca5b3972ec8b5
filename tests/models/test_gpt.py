"""The GPT example's train step held to a contract written from the formulas.

``examples/gpt.py`` (Llama style: causal zigzag ring over seq, GQA, TP over model, the
vocabulary split over model, DP over data) compiled on a few meshes, its collectives
declared by hand with ``comm.contract``: every op count exact and bytes within 1%, no
implicit collectives; the logits [B, T, V] never travel (the loss reduces [B, T] floats).
The ring's K/V blocks carry h_kv/n_model heads (one under ``kv_repeat``), so with GQA the
ring moves h_kv/h of what multi-head attention moves, in the ledger of the whole step, not
only of the attention alone.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import shardkit
from shardkit.comm import contract
from shardkit.parallel.sequence import layouts

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpt", ROOT / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)

BATCH, W = 8, 4  # float32 words


@pytest.fixture(autouse=True)
def numpy_broadcasting():
    """The example is user code written with NumPy's rank promotion (JAX's default)."""
    with jax.numpy_rank_promotion("allow"):
        yield


def expected(mesh, dims, local_params, experts=None):
    """The collectives of one clipped train step, per device, from the ring formulas."""
    n_data, n_seq, n_model = (mesh.shape[a] for a in ("data", "seq", "model"))
    n_ep = mesh.shape["expert"]
    b, t, layers = BATCH // (n_data * n_ep), dims["tokens"] // n_seq, dims["layers"]
    head_dim = dims["dim"] // dims["heads"]
    out = [] if experts is None else moe_terms(mesh, dims, experts, b * t)
    if n_model > 1:  # Megatron g forward and f backward, in attention and in the MLP
        acts, per_token = b * t * dims["dim"] * W, b * t * W
        regions = 2 if experts is None else 1  # a MoE block's MLP region is in moe_terms
        out += [
            contract.all_reduce("model", acts, n_model, 2 * regions * layers + 2,
                                "Megatron f, g; the vocab embedding's g, the head's f"),
            contract.all_reduce("model", per_token, n_model, 1, "cross-entropy max (pmax)"),
            contract.all_reduce("model", 2 * per_token, n_model, 1,
                                "Σ exp and the target logit (one combined op)"),
        ]  # fmt: skip
        if n_model > dims["kv_heads"]:  # kv_repeat: whole K / V weights, gradients summed
            kv = 2 * dims["dim"] * dims["kv_heads"] * head_dim * W
            term = contract.all_reduce("model", kv, n_model, layers, "K, V weight gradients")
            out.append(dataclasses.replace(term, count=0))  # combined into a block's own op
    if n_seq > 1:  # K, V: n−1 hops forward and again backward; dK, dV: n hops home
        local_kv = max(dims["kv_heads"] // n_model, 1)  # kv_repeat: one head per device
        kv = b * t * local_kv * head_dim * W
        hops = 2 * layers * (n_seq - 1) * 2 + 2 * layers * n_seq
        out.append(contract.permute("seq", kv, hops, "K, V, dK, dV blocks of h_kv heads"))
    sync = tuple(a for a in ("data", "expert", "seq") if mesh.shape[a] > 1)
    if sync:  # every gradient bucket and the loss, combined into one op at the step's end
        expert_leaves = 0 if experts is None else expert_param_count(mesh, dims, experts)
        size = (local_params - expert_leaves + 1) * W
        out.append(contract.all_reduce(sync, size, n_data * n_ep * n_seq, 1, "gradients + loss"))
    axes = tuple(a for a in ("data", "expert", "seq", "model") if mesh.shape[a] > 1)
    out.append(contract.all_reduce(axes, W, mesh.size, 1, "global gradient norm (clipping)"))
    return out


def expert_param_count(mesh, dims, experts):
    """Elements of one device's expert weights (gate, up, down of its E/X experts)."""
    local = experts.experts // mesh.shape["expert"]
    return 3 * dims["layers"] * local * dims["dim"] * dims["mlp"] // mesh.shape["model"]


def moe_terms(mesh, dims, experts, tokens):
    """A MoE block's collectives: per layer, dispatch and combine all-to-alls over expert
    (forward and backward) of the local buffer [E, C, d], the counts' all-reduce; inside each
    expert, TP's g and f on [E/X, X·C, d] (the same bytes); the experts' gradients synced over
    data and seq, never over expert."""
    n_ep, n_model, layers = mesh.shape["expert"], mesh.shape["model"], dims["layers"]
    buffers = experts.experts * experts.capacity(tokens) * dims["dim"] * W
    groups = tuple(a for a in ("data", "expert", "seq") if mesh.shape[a] > 1)
    n_groups = int(np.prod([mesh.shape[a] for a in groups]))
    out = [contract.all_to_all("expert", buffers, n_ep, 4 * layers, "dispatch, combine ×2"),
           contract.all_reduce(groups, (experts.experts + 1) * W, n_groups, layers,
                               "tokens per expert, dropped")]  # fmt: skip
    if n_model > 1:
        out.append(contract.all_reduce("model", buffers, n_model, 2 * layers, "experts' g, f"))
    sync = tuple(a for a in ("data", "seq") if mesh.shape[a] > 1)
    if sync:
        size = expert_param_count(mesh, dims, experts) * W
        n = int(np.prod([mesh.shape[a] for a in sync]))
        out.append(contract.all_reduce(sync, size, n, 1, "expert gradients (not over expert)"))
    return out


def local_param_count(model, params):
    """Elements of the params one device holds (its fragments)."""
    placed = model.shard(params)
    return sum(leaf.addressable_shards[0].data.size for leaf in jax.tree.leaves(placed))


def measured_step(shape, kv_heads, experts=None):
    """(ledger of the GPT's clipped train step, its contract), compiled on ``shape``."""
    mesh = shardkit.make_mesh(shape)
    dims = {**gpt.dims_of(experts), "kv_heads": kv_heads}
    model = gpt.sharded_gpt(mesh, "zigzag", dims=dims, experts=experts)
    params = gpt.init(0, dims, experts.experts if experts else 0)
    optimizer = optax.adamw(1e-3)
    step = model.train_step(optimizer, clip_norm=1.0)
    p = model.shard(params)
    state = model.init_opt_state(optimizer, p)
    x, y = gpt.windows(np.random.default_rng(0), BATCH, dims["tokens"])
    n_seq = mesh.shape["seq"]
    batch = model.shard_batch(*(layouts.to_layout(a, n_seq, "zigzag") for a in (x, y)))
    want = expected(mesh, dims, local_param_count(model, params), experts)
    return contract.assert_contract(step, p, state, *batch, expected=want)


MESHES = [  # the last: model outnumbers the KV heads (kv_repeat)
    {"data": 2, "seq": 2, "model": 2},
    {"seq": 4, "model": 2},
    {"data": 2, "seq": 4},
    {"seq": 2, "model": 4},
]


@pytest.mark.parametrize("shape", MESHES)
def test_gpt_step_meets_its_contract(shape):
    measured_step(shape, kv_heads=2)


def test_gqa_ring_moves_h_kv_over_h_of_mha_in_the_whole_step():
    """Same mesh and model, 8 query heads: 1 KV head (MQA) vs 8 (MHA), ring bytes 1 : 8."""
    shape = {"seq": 4}
    key = ("collective-permute", ("seq",))
    mqa = measured_step(shape, kv_heads=1).summary()[key]
    mha = measured_step(shape, kv_heads=8).summary()[key]
    assert mqa.count == mha.count
    assert mqa.bytes_sent * 8 == mha.bytes_sent


MOE_MESHES = [
    {"data": 2, "expert": 4},
    {"data": 2, "expert": 2, "model": 2},
    {"expert": 2, "seq": 4},
]


@pytest.mark.parametrize("shape", MOE_MESHES)
def test_moe_gpt_step_meets_its_contract(shape):
    """The MoE GPT (E = 8, top-2, capacity 1.25) under EP × DP, EP × TP × DP, EP × ring: the
    all-to-alls, counts and expert-gradient sync exact, beside every dense term."""
    measured_step(shape, kv_heads=2, experts=gpt.moe.MoE(8, 2, 1.25))
