"""The backward cut into B (input gradient) and W (weight gradient) for zero-bubble schedules.

``SplitBackward`` on a chunk's vjp: B's dx and W's weight gradients equal the whole vjp's, and
every matmul of the backward runs in exactly one of the two (their dot counts add up to the
whole backward's, and W holds the weight-gradient matmuls), on the ViT's blocks scanned and
unrolled, under every remat policy, and on an MLP.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core

import vit_ref
from shardkit import testing
from shardkit.parallel.pipeline.split import SplitBackward
from vit_ref import model as ref

CFG = vit_ref.ViTConfig(
    image=8, patch=4, channels=3, classes=5, dim=16, depth=3, heads=2, mlp_dim=32,
    pool="tok", head_zeroinit=False,
)  # fmt: skip


def dots(jaxpr: core.Jaxpr) -> int:
    """dot_general equations run by ``jaxpr`` (a scan body counts its length)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "dot_general"
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        n += times * sum(dots(sub) for sub in core.jaxprs_in_params(eqn.params))
    return n


def split_of(fn, params, x):
    """(the whole backward, its split, the vjp leaves, a random cotangent)."""
    y, vjp = jax.vjp(fn, params, x)
    leaves, tree = jax.tree.flatten(vjp)

    def bwd(res, dy):
        return jax.tree.unflatten(tree, res)(dy)

    dy = jnp.asarray(np.random.default_rng(1).normal(size=y.shape), y.dtype)
    return bwd, SplitBackward(bwd, leaves, dy), leaves, dy


def blocks_fn(layers: str, remat: str):
    block = ref.remat_block(lambda x, p: ref.block(x, p, None), remat)
    return lambda blocks, x: ref.run_layers(block, x, blocks, layers)[0]


@pytest.mark.parametrize("layers", ["scan", "unrolled"])
@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_b_and_w_equal_the_whole_backward_and_share_no_matmul(layers, remat):
    blocks = vit_ref.init(jax.random.key(0), CFG)["blocks"]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, CFG.dim)), jnp.float32)
    bwd, split, leaves, dy = split_of(blocks_fn(layers, remat), blocks, x)
    want_dp, want_dx = bwd(leaves, dy)
    dx, cut = split.input_grad(leaves, dy)
    dp = split.weight_grad(leaves, dy, cut=cut)
    testing.assert_trees_close(dx, want_dx, tol=1e-6, what="dx")
    testing.assert_trees_close(dp, want_dp, tol=1e-5, what="weight gradients")

    whole = dots(jax.make_jaxpr(bwd)(leaves, dy).jaxpr)
    in_b = dots(jax.make_jaxpr(split.input_grad)(leaves, dy).jaxpr)
    weights = jax.make_jaxpr(lambda r, d, c: split.weight_grad(r, d, cut=c))
    in_w = dots(weights(leaves, dy, cut).jaxpr)
    assert in_b + in_w == whole, (in_b, in_w, whole)
    # W runs each layer's six weight matmuls (q, k, v, out, fc1, fc2) at least.
    assert in_w >= 6 * CFG.depth, in_w


def test_an_mlp_hands_w_the_hidden_cotangent_only():
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
    }

    def mlp(p, x):
        return x + jnp.tanh(x @ p["w1"]) @ p["w2"]

    x = jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)
    bwd, split, leaves, dy = split_of(mlp, params, x)
    _, cut = split.input_grad(leaves, dy)
    # fc2's weight gradient reads dy itself; fc1's the cotangent at its output, [3, 16].
    assert [c.shape for c in cut] == [(3, 16)]
    testing.assert_trees_close(split.weight_grad(leaves, dy, cut=cut), bwd(leaves, dy)[0], tol=1e-6)
