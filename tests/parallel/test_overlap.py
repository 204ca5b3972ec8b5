"""``parallel.overlap``: collective matmuls (all-gather · matmul, matmul · reduce-scatter) as
ring steps with hand-written backward rules.

Held here: equal to the plain collective and matmul (the output and both gradients, float32 at
full precision) on every axis size 2–8, beside a data axis; on XLA:CPU only collective-permutes
over the axis, n − 1 per ring and four rings per forward-and-backward, sending exactly the
plain program's bytes; and, compiled for a v5e:2x4 slice by the TPU compiler on this CPU
machine, exactly the analytic minimum with most of it (71%) scheduled under a matmul, where
the plain program's collectives hide nothing. (At M = 8,192, K = 2,048 the compiler also
rewrites the plain program's reduce-scatters into all-reduces, 1.56× the bytes:
docs/strategies/overlap.md.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit
from shardkit import testing
from shardkit.comm import ledger
from shardkit.parallel import collectives, overlap
from shardkit.run import target

K = 8


def plain_ag(x, w):
    return collectives.all_gather(x, "model", axis_dim=0, tiled=True) @ w


def plain_rs(a, w):
    return collectives.reduce_scatter(a @ w, "model", scatter_dim=0, tiled=True)


def ours_ag(x, w):
    return overlap.ag_matmul(x, w, "model")


def ours_rs(a, w):
    return overlap.matmul_rs(a, w, "model")


def block(ag, rs):
    """x[M_model, K] -> ag with w1[K, F_model] -> gelu -> rs with w2[F_model, K] -> [M_model, K]."""
    return lambda x, w1, w2: rs(jax.nn.gelu(ag(x, w1)), w2)


def step(mesh, body):
    """jit(value_and_grad) of Σ sin(out) through a shard_map of ``body`` (batch over data)."""
    specs = (P("data", "model"), P(None, "model"), P("model"))
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("data", "model"))
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)))


def inputs(n, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(2, 4 * n, K), (K, 3 * n), (3 * n, K)]  # x[data, M, K], w1[K, F], w2[F, K]
    return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_equal_to_the_plain_collective_and_matmul(n):
    mesh = shardkit.make_mesh({"data": 2, "model": n})
    body = lambda f: lambda x, w1, w2: f(x[0], w1, w2)[None]  # noqa: E731
    with testing.parity_precision():
        want = step(mesh, body(block(plain_ag, plain_rs)))(*inputs(n))
        got = step(mesh, body(block(ours_ag, ours_rs)))(*inputs(n))
    assert float(got[0]) == pytest.approx(float(want[0]), abs=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        assert float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) <= 1e-5


def test_only_permutes_with_the_plain_bytes_on_cpu():
    """Four rings of n − 1 permutes (AG and RS forward, RS and AG backward), the plain
    program's bytes; the one all-reduce in both is the loss's sum over the devices."""
    n = 8
    mesh = shardkit.make_mesh({"data": 1, "model": n})
    body = lambda f: lambda x, w1, w2: f(x[0], w1, w2)[None]  # noqa: E731
    args = inputs(n)
    args[0] = args[0][:1]
    plain = ledger.measure(step(mesh, body(block(plain_ag, plain_rs))), *args, mesh=mesh)
    ours = ledger.measure(step(mesh, body(block(ours_ag, ours_rs))), *args, mesh=mesh)
    kinds = {kind for kind, _ in ours.summary()}
    assert kinds == {"collective-permute", "all-reduce"}
    assert ours.summary()[("collective-permute", ("model",))].count == 4 * (n - 1)
    loss = ("all-reduce", ("model",))
    assert ours.summary()[loss].bytes_sent == plain.summary()[loss].bytes_sent
    assert ours.total_bytes_sent() == plain.total_bytes_sent()


def test_hidden_under_matmuls_on_the_tpu_compiler():
    devices = target.topology_devices("v5e:2x4").reshape(-1)
    mesh = shardkit.make_mesh({"model": 8}, devices=devices)
    m, k, f = 8 * 256, 512, 8 * 256
    sharded = lambda shape, spec: jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec)
    )
    args = (sharded((1, m, k), P(None, "model")), sharded((k, f), P(None, "model")),
            sharded((f, k), P("model")))  # fmt: skip
    specs = (P(None, "model"), P(None, "model"), P("model"))

    def compiled(ag, rs):
        body = block(ag, rs)
        fn = jax.shard_map(lambda x, a, b: body(x[0], a, b)[None], mesh=mesh, in_specs=specs,
                           out_specs=P(None, "model"))  # fmt: skip
        grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2), (0, 1, 2)))
        return ledger.ledger_of(grad.lower(*args).compile(), mesh)

    ours, plain = compiled(ours_ag, ours_rs), compiled(plain_ag, plain_rs)
    minimum = 4 * 7 / 8 * m * k * 2  # AG of x, RS of the product, and both again backward; bf16
    assert ours.total_bytes_sent() == minimum
    assert ours.overlapped_fraction >= 0.6
    assert plain.overlapped_fraction < 0.05
