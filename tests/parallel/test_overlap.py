"""``parallel.overlap``: collective matmuls (all-gather · matmul, matmul · reduce-scatter) as
ring steps with hand-written backward rules.

Held here: equal to the plain collective and matmul (the output and both gradients, float32 at
full precision) on every axis size 2–8, beside a data axis; on XLA:CPU only collective-permutes
over the axis, n − 1 per ring and four rings per forward-and-backward, sending exactly the
plain program's bytes; and, compiled for a v5e:2x4 slice by the TPU compiler on this CPU
machine, exactly the analytic minimum with every byte scheduled under a matmul, where the
plain program's collectives hide nothing. (At M = 8,192, K = 2,048 the compiler also
rewrites the plain program's reduce-scatters into all-reduces, 1.56× the bytes:
docs/strategies/overlap.md.)"""

from __future__ import annotations

import functools

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
from shardkit.parallel import data as dp
from shardkit.run import target

K = 8


def plain_ag(x, w):
    return collectives.all_gather(x, "model", axis_dim=0, tiled=True) @ w


def plain_rs(a, w):
    return collectives.reduce_scatter(a @ w, "model", scatter_dim=0, tiled=True)


def ours_ag(x, w, bidirectional=False):
    return overlap.ag_matmul(x, w, "model", bidirectional)


def ours_rs(a, w, bidirectional=False):
    return overlap.matmul_rs(a, w, "model", bidirectional)


def ours(bidirectional):
    """(ag, rs): the collective matmuls, one-way rings or both ways."""
    return (functools.partial(ours_ag, bidirectional=bidirectional),
            functools.partial(ours_rs, bidirectional=bidirectional))  # fmt: skip


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


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_equal_to_the_plain_collective_and_matmul(n, bidirectional):
    mesh = shardkit.make_mesh({"data": 2, "model": n})
    body = lambda f: lambda x, w1, w2: f(x[0], w1, w2)[None]  # noqa: E731
    with testing.parity_precision():
        want = step(mesh, body(block(plain_ag, plain_rs)))(*inputs(n))
        got = step(mesh, body(block(*ours(bidirectional))))(*inputs(n))
    assert float(got[0]) == pytest.approx(float(want[0]), abs=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        assert float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) <= 1e-5


@pytest.mark.parametrize("bidirectional", [False, True])
def test_only_permutes_with_the_plain_bytes_on_cpu(bidirectional):
    """Four rings of n − 1 permutes (AG and RS forward, RS and AG backward), each one-way or,
    bidirectional, a ring of half blocks each way: the plain program's bytes; the one
    all-reduce in both is the loss's sum over the devices."""
    n = 8
    mesh = shardkit.make_mesh({"data": 1, "model": n})
    body = lambda f: lambda x, w1, w2: f(x[0], w1, w2)[None]  # noqa: E731
    args = inputs(n)
    args[0] = args[0][:1]
    plain = ledger.measure(step(mesh, body(block(plain_ag, plain_rs))), *args, mesh=mesh)
    got = ledger.measure(step(mesh, body(block(*ours(bidirectional)))), *args, mesh=mesh)
    kinds = {kind for kind, _ in got.summary()}
    assert kinds == {"collective-permute", "all-reduce"}
    rings = 8 if bidirectional else 4
    assert got.summary()[("collective-permute", ("model",))].count == rings * (n - 1)
    shifts = {"shift +1", "shift -1"} if bidirectional else {"shift +1"}
    assert set(got.patterns()[("collective-permute", ("model",))]) == shifts
    loss = ("all-reduce", ("model",))
    assert got.summary()[loss].bytes_sent == plain.summary()[loss].bytes_sent
    assert got.total_bytes_sent() == plain.total_bytes_sent()


def test_bidirectional_needs_blocks_that_halve():
    mesh = shardkit.make_mesh({"data": 2, "model": 2})
    x, w1, _ = inputs(2)
    f = jax.shard_map(lambda x, w: ours_ag(x[0, :3], w, True)[None], mesh=mesh,
                      in_specs=(P("data", "model"), P(None, "model")),
                      out_specs=P("data", None, "model"))  # fmt: skip
    with pytest.raises(ValueError, match="a block of 3 rows does not split in halves"):
        f(x, w1)


M_TPU, K_TPU, F_TPU = 8 * 256, 512, 8 * 256


@functools.cache  # one compile per program: the persistent cache cannot reload a topology's
def tpu_ledger(form: str) -> ledger.Ledger:
    """The ledger of the block's gradient compiled for v5e:2x4 (``form``: plain, one-way or
    both ways)."""
    devices = target.topology_devices("v5e:2x4").reshape(-1)
    mesh = shardkit.make_mesh({"model": 8}, devices=devices)
    sharded = lambda shape, spec: jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec)
    )
    m, k, f = M_TPU, K_TPU, F_TPU
    args = (sharded((1, m, k), P(None, "model")), sharded((k, f), P(None, "model")),
            sharded((f, k), P("model")))  # fmt: skip
    specs = (P(None, "model"), P(None, "model"), P("model"))
    body = block(plain_ag, plain_rs) if form == "plain" else block(*ours(form == "both ways"))
    fn = jax.shard_map(lambda x, a, b: body(x[0], a, b)[None], mesh=mesh, in_specs=specs,
                       out_specs=P(None, "model"))  # fmt: skip
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2), (0, 1, 2)))
    return ledger.ledger_of(grad.lower(*args).compile(), mesh)


@pytest.mark.parametrize("form", ["one-way", "both ways"])
def test_hidden_under_matmuls_on_the_tpu_compiler(form):
    got, plain = tpu_ledger(form), tpu_ledger("plain")
    minimum = 4 * 7 / 8 * M_TPU * K_TPU * 2  # AG of x, RS of the product, both again backward
    assert got.total_bytes_sent() == minimum  # bf16
    assert got.overlapped_fraction >= 0.95  # every byte (71% one-way before the barriers)
    assert plain.overlapped_fraction < 0.05


# ------------------------------------------------- gradient sync one layer behind (prefetch)

L, D = 3, 3 * K  # D splits over 2, 3 and 4


def layer(x, w):
    return x + jnp.tanh(x @ w)


def layers_step(mesh, run, x_spec, w_spec):
    """jit(value_and_grad) of Σ sin(x after L layers) through a shard_map of ``run(x, ws)``,
    which returns (this device's loss share, the synced gradients of ws)."""
    f = jax.shard_map(run, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=(P(), w_spec))
    return jax.jit(f)


def layers_inputs(batch, seed=1):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, D)), jnp.float32)
    return x, jnp.asarray(rng.normal(size=(L, D, D)) / np.sqrt(D), jnp.float32)


def steps(n):
    """Permutes of one reduce-scatter by ``overlap.scatter_by_permutes`` over n devices."""
    return n.bit_length() - 1 if n & (n - 1) == 0 else n - 1


def patterns(n):
    """Their patterns: exchanges at distance n/2 (a shift), ..., 1 (xor), or a ring's shift."""
    if n & (n - 1):
        return {"shift +1"}
    return {ledger.exchange(2**k, n) for k in range(steps(n))}


def dp_runs(axes):
    """(plain, ours): DP's step-end all-reduce, and each layer's all-reduced one layer behind
    (``data.sync_in_backward`` through ``data.prefetch_layers``)."""

    def plain(x, ws):
        def loss(ws):
            y, _ = jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws)
            return jnp.sum(jnp.sin(y))

        share, g = jax.value_and_grad(loss)(dp.vary(ws, axes))
        return jax.lax.psum(share, axes), dp.sync_grads(g, axes)

    def ours(x, ws):
        sync = functools.partial(dp.sync_in_backward, axes_tree=axes)
        share, g = jax.value_and_grad(
            lambda ws: jnp.sum(jnp.sin(dp.prefetch_layers(layer, sync, x, ws)))
        )(ws)
        return jax.lax.psum(dp.vary(share, axes), axes), g

    return plain, ours


@pytest.mark.parametrize(
    "shape", [{"data": 2}, {"data": 3}, {"data": 4, "model": 2}, {"data": 2, "seq": 2}]
)
def test_dp_sync_one_layer_behind_equals_the_step_end_all_reduce(shape):
    """``sync_in_backward`` (a reduce-scatter of permutes and an all-gather per layer, in the
    next layer's backward step) gives the step-end all-reduce's gradients, over one axis or
    two, with exactly the all-reduce's bytes: recursive halving's exchanges (i with i XOR d)
    on 2 and 4 devices, a ring's n − 1 shifts on 3, and L all-gathers."""
    mesh = shardkit.make_mesh(shape)
    axes = tuple(a for a in ("data", "seq") if a in shape)
    n = int(np.prod([shape[a] for a in axes]))
    x, ws = layers_inputs(4 * n)
    plain, ours = (layers_step(mesh, r, P(axes), P()) for r in dp_runs(axes))
    with testing.parity_precision():
        want, got = plain(x, ws), ours(x, ws)
    testing.assert_trees_close(got, want, 1e-5)
    led = ledger.measure(ours, x, ws, mesh=mesh)
    # Over data × seq an exchange flips one axis' coordinate: the ledger books it there.
    hops = [c for c in led.collectives if c.kind == "collective-permute"]
    assert sum(c.count for c in hops) == steps(n) * L
    if len(axes) == 1:
        assert {c.pattern for c in hops} == patterns(n)
    else:
        assert {(c.axes, c.pattern) for c in hops} == {
            (("data",), "shift +1"),
            (("seq",), "shift +1"),
        }
    assert led.summary()[("all-gather", axes)].count == L
    padded = -(-D * D // (n * 128)) * n * 128  # one layer's bucket as [n, r, 128]
    assert led.total_bytes_sent() - led.summary()[("all-reduce", axes)].bytes_sent == (
        2 * (n - 1) / n * padded * 4 * L
    )


@pytest.mark.parametrize("n", [2, 3, 4])
def test_fsdp_permuted_back_equals_the_reduce_scatter(n):
    """FSDP's gather with ``permuted_back`` (its transpose a reduce-scatter of permutes:
    recursive halving on 2 and 4 devices, a ring on 3), each layer gathered one layer ahead:
    the plain gather's gradients, with no reduce-scatter left."""
    mesh = shardkit.make_mesh({"data": n})

    def run(permuted_back):
        def body(x, ws):
            gather = functools.partial(dp.fsdp_gather, dims_tree=0, permuted_back=permuted_back)
            loss = lambda ws: jnp.sum(jnp.sin(dp.prefetch_layers(layer, gather, x, ws)))  # noqa: E731
            share, g = jax.value_and_grad(loss)(ws)
            return jax.lax.psum(share, "data"), g

        return layers_step(mesh, body, P("data"), P(None, "data"))

    x, ws = layers_inputs(2 * n)
    with testing.parity_precision():
        want, got = run(False)(x, ws), run(True)(x, ws)
    testing.assert_trees_close(got, want, 1e-5)
    ringed = ledger.measure(run(True), x, ws, mesh=mesh).summary()
    assert ("reduce-scatter", ("data",)) not in ringed
    assert ringed[("collective-permute", ("data",))].count == steps(n) * L


def test_sync_in_backward_names_a_mismatched_axes_tree():
    """A tuple of axis tuples reads as one leaf (the axes trees' convention): one sentence."""
    mesh = shardkit.make_mesh({"data": 2})
    sync = functools.partial(dp.sync_in_backward, axes_tree=(("data",), ("data",)))
    body = jax.shard_map(lambda a, b: sync((a, b)), mesh=mesh, in_specs=P(), out_specs=P("data"))
    with pytest.raises(ValueError, match="axes_tree has 1 axis tuples, the tree 2 leaves"):
        jax.eval_shape(body, jnp.ones(2), jnp.ones(2))


def tp_region(f, g):
    """x[B, K] (invariant over model) -> f -> · w1[K, F_model] -> sin -> · w2[F_model, K] -> g:
    plain TP's region with its entry ``f`` and exit ``g``."""
    return lambda x, w1, w2: g(jnp.sin(f(x) @ w1) @ w2)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_permuted_all_reduces_equal_megatron_f_and_g(n):
    """``reduced_back`` and ``all_reduce_permuted`` (its forward, and ``reduce_beside``'s) are
    Megatron f and g: the output and every gradient of a TP region, padded or not (x of 5
    rows of K = 8: 40 elements laid out as [n, 1, 128]), with only permutes and all-gathers
    over model."""
    mesh = shardkit.make_mesh({"data": 2, "model": n})
    plain = tp_region(functools.partial(collectives.megatron_f, axis="model"),
                      functools.partial(collectives.megatron_g, axis="model"))  # fmt: skip
    beside = lambda y: overlap.reduce_beside(y, jnp.ones_like(y), "model")[0]  # noqa: E731
    ours = {
        "all_reduce_permuted": tp_region(
            functools.partial(overlap.reduced_back, axis="model"),
            functools.partial(overlap.all_reduce_permuted, axis="model"),
        ),
        "reduce_beside": tp_region(functools.partial(overlap.reduced_back, axis="model"), beside),
    }

    def run(body):
        specs = (P("data"), P(None, "model"), P("model"))
        f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("data"))
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.cos(f(*a))), argnums=(0, 1, 2)))

    rng = np.random.default_rng(n)
    args = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((10, K), (K, 3 * n), (3 * n, K))]
    with testing.parity_precision():
        want = run(plain)(*args)
        for name, body in ours.items():
            testing.assert_trees_close(run(body)(*args), want, 1e-5, what=name)
    kinds = {kind for kind, axes in ledger.measure(run(ours["reduce_beside"]), *args, mesh=mesh)
             .summary() if axes == ("model",)}  # fmt: skip
    assert kinds == {"collective-permute", "all-gather"}


def test_reduce_beside_names_a_value_of_another_type():
    """The barrier takes one type: a value beside the reduction varying over other axes is
    refused in one sentence."""
    mesh = shardkit.make_mesh({"data": 2, "model": 2})
    body = lambda y, u: overlap.reduce_beside(y, u, "model")  # noqa: E731
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("data", "model"), P()),
                      out_specs=(P("data"), P()))  # fmt: skip
    with pytest.raises(ValueError, match="reduce_beside: the reduced block varies over"):
        jax.eval_shape(f, jnp.ones((2, 256)), jnp.ones(3))
