"""Verify your own sharded model on CPU meshes: a property test with ``shardkit.testing``.

A user's two-layer MLP, tensor-parallel over ``model`` (``tensor.mlp_tp``: W1 column-split,
W2 row-split, one all-reduce forward) and data-parallel over ``data`` (``data.vary`` +
``data.sync_grads``). Hypothesis draws the mesh (every factorisation of 1..8 devices into
``data × model``, sizes 1, 3 and 6 included) and the widths; each example checks the loss and
every gradient leaf against the unsharded twin, and the compiled step's collectives against
what the two strategies must send:

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

from shardkit import data, ledger, tensor, testing  # noqa: E402

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
    # The contract: one all-reduce over model (mlp_tp's forward psum; its backward one would
    # sum dx, which nothing here needs, so XLA drops it) and one bucketed all-reduce over data.
    # (An axis of size 1 leaves a one-device all-reduce that sends nothing: axes == ().)
    summary = ledger.measure(fn, place(p), x, y, mesh=mesh).summary()
    counts = {key: t.count for key, t in summary.items() if key[1]}
    want = {("all-reduce", ("model",)): 1} if shape["model"] > 1 else {}
    want |= {("all-reduce", ("data",)): 1} if shape["data"] > 1 else {}
    assert counts == want, (shape, counts)
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
