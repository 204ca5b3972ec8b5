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


def expected(mesh, dims, local_params):
    """The collectives of one clipped train step, per device, from the ring formulas."""
    n_data, n_seq, n_model = (mesh.shape[a] for a in ("data", "seq", "model"))
    b, t, layers = BATCH // n_data, dims["tokens"] // n_seq, dims["layers"]
    head_dim = dims["dim"] // dims["heads"]
    out = []
    if n_model > 1:  # Megatron g forward and f backward, in attention and in the MLP
        acts, per_token = b * t * dims["dim"] * W, b * t * W
        out += [
            contract.all_reduce("model", acts, n_model, 4 * layers + 2,
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
    sync = tuple(a for a in ("data", "seq") if mesh.shape[a] > 1)
    if sync:  # every gradient bucket and the loss, combined into one op at the step's end
        size = (local_params + 1) * W
        out.append(contract.all_reduce(sync, size, n_data * n_seq, 1, "gradients + loss"))
    axes = tuple(a for a in ("data", "seq", "model") if mesh.shape[a] > 1)
    out.append(contract.all_reduce(axes, W, mesh.size, 1, "global gradient norm (clipping)"))
    return out


def local_param_count(model, params):
    """Elements of the params one device holds (its fragments)."""
    placed = model.shard(params)
    return sum(leaf.addressable_shards[0].data.size for leaf in jax.tree.leaves(placed))


def measured_step(shape, kv_heads):
    """(ledger of the GPT's clipped train step, its contract), compiled on ``shape``."""
    mesh = shardkit.make_mesh(shape)
    dims = {**gpt.DIMS, "kv_heads": kv_heads}
    model = gpt.sharded_gpt(mesh, "zigzag", dims=dims)
    params = gpt.init(0, dims)
    optimizer = optax.adamw(1e-3)
    step = model.train_step(optimizer, clip_norm=1.0)
    p = model.shard(params)
    state = model.init_opt_state(optimizer, p)
    x, y = gpt.windows(np.random.default_rng(0), BATCH, dims["tokens"])
    n_seq = mesh.shape["seq"]
    batch = model.shard_batch(*(layouts.to_layout(a, n_seq, "zigzag") for a in (x, y)))
    want = expected(mesh, dims, local_param_count(model, params))
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
