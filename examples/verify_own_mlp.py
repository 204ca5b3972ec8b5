"""Verify your own sharded model on CPU meshes: a property test with ``shardkit.testing``.

A user's two-layer MLP, tensor-parallel over ``model`` (``tensor.mlp_tp``: W1 column-split,
W2 row-split, one all-reduce forward) and data-parallel over ``data`` (``data.vary`` +
``data.sync_grads``). Hypothesis draws the mesh (every factorisation of 1..8 devices into
``data × model``, sizes 1, 3 and 6 included) and the widths; each example checks the loss and
every gradient leaf and one optimizer step against the unsharded twin
(``testing.compare_sharded``), and the compiled step's collectives against the bytes the two
strategies must send (``comm.contract.assert_contract``):

    python examples/verify_own_mlp.py [--examples 20]
"""

import argparse
import math

import shardkit

shardkit.set_cpu_devices(8)  # before any other JAX call

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardkit import data, tensor, testing  # noqa: E402
from shardkit.comm import contract  # noqa: E402

# --8<-- [start:layout]
# W1[D, F_model] column-parallel, W2[F_model, D] row-parallel; b2 added once, after the psum.
SPECS = {"fc1": {"kernel": P(None, "model"), "bias": P("model")},
         "fc2": {"kernel": P("model", None), "bias": P()}}  # fmt: skip
SYNC = {"fc1": {"kernel": ("data",), "bias": ("data",)},
        "fc2": {"kernel": ("data",), "bias": ("data",)}}  # fmt: skip
# --8<-- [end:layout]


# --8<-- [start:sharded]
def loss_twin(p, x, y):
    """The unsharded reference: mean squared error of a GELU MLP."""
    h = jax.nn.gelu(x @ p["fc1"]["kernel"] + p["fc1"]["bias"])
    return jnp.mean((h @ p["fc2"]["kernel"] + p["fc2"]["bias"] - y) ** 2)


def loss_and_grads_sharded(mesh, batch):
    def body(p, x, y):  # x, y[B_data, T, D]; p per SPECS
        p = data.vary(p, SYNC)  # dw{U_data} stays unreduced until sync_grads

        def loss(p):
            out = tensor.mlp_tp(x, p, "model", jax.nn.gelu)  # one psum over model
            return jnp.sum((out - y) ** 2) / (batch * y.shape[1] * y.shape[2])

        value, grads = jax.value_and_grad(loss)(p)
        return jax.lax.psum(value, "data"), data.sync_grads(grads, SYNC)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(SPECS, P("data"), P("data")),
                       out_specs=(P(), SPECS))  # fmt: skip
    return jax.jit(fn)


# --8<-- [end:sharded]


# --8<-- [start:meshes]
@st.composite
def cases(draw):
    d, f, batch = draw(st.sampled_from([4, 8])), draw(st.integers(1, 6)), draw(st.integers(1, 8))
    # Every axis size divides what it splits: the hidden width over model, the batch over data.
    shape = draw(testing.meshes_dividing({"data": [batch], "model": [f]}, max_devices=8))
    return shape, d, f, batch


# --8<-- [end:meshes]


# --8<-- [start:compare]
def check(shape, d, f, batch):
    mesh = shardkit.make_mesh(shape)
    rng = np.random.default_rng(0)
    p = {"fc1": {"kernel": rng.normal(size=(d, f)), "bias": rng.normal(size=f)},
         "fc2": {"kernel": rng.normal(size=(f, d)), "bias": rng.normal(size=d)}}  # fmt: skip
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)
    x, y = (jnp.asarray(rng.normal(size=(batch, 3, d)), jnp.float32) for _ in range(2))

    def place(params):  # each leaf split over the mesh per SPECS
        return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, SPECS)

    fn = loss_and_grads_sharded(mesh, batch)
    # One call: the loss, every gradient leaf and one AdamW step, each leaf within 1e-5.
    testing.compare_sharded(fn, loss_twin, p, x, y, place=place).assert_ok()
    # --8<-- [end:compare]
    # --8<-- [start:contract]
    # The contract, in bytes sent per device: mlp_tp's forward psum of the local output over
    # model (its backward one would sum dx, which nothing here needs, so XLA drops it), and the
    # gradients of every local leaf plus the loss in one bucketed all-reduce over data (XLA
    # combines the buckets at the step's end). An axis of size 1 declares nothing.
    n_data, n_model = shape["data"], shape["model"]
    local_grads = (d * f + f + f * d) // n_model + d  # fc1 and fc2's kernel split, b2 whole
    expected = []
    if n_model > 1:
        out_bytes = batch // n_data * 3 * d * 4
        expected.append(contract.all_reduce("model", out_bytes, n_model, why="mlp_tp's psum"))
    if n_data > 1:
        grad_bytes = (local_grads + 1) * 4
        expected.append(contract.all_reduce("data", grad_bytes, n_data, why="gradients + loss"))
    contract.assert_contract(fn, place(p), x, y, expected=expected, mesh=mesh)
    # --8<-- [end:contract]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20)
    n = parser.parse_args().examples
    seen = []

    @settings(max_examples=n, deadline=None, derandomize=True)
    @given(cases())
    def prop(case):
        check(*case)
        seen.append(math.prod(case[0].values()))

    prop()
    print(f"{len(seen)} examples on meshes of {sorted(set(seen))} devices: sharded == twin")


if __name__ == "__main__":
    main()
