"""shardkit.collectives: wrappers, ring and bidirectional versions equal the built-ins exactly.

Harness: a global array ``[devices, *block]`` sharded over every mesh axis hands each device
its own block, and each device's result comes back the same way, so any collective (invariant
results included) is compared device by device. Data are small integers, exact in int32 and
float32, so forward values AND gradients must equal the built-ins' bit for bit whatever the
summation order. The loss ``sum(w * y**3)`` is non-linear with per-device weights w: every
device's cotangent differs, so a misplaced block or a missing sum cannot cancel out.

Gradients are taken two ways: inside the body (every input varying) and outside ``shard_map``
with the input replicated over the collective's axis (invariant there), which exercises the
implicit varying-casts and their psum transposes at the boundary.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import shardkit
from shardkit import collectives as coll
from shardkit import testing
from shardkit.comm import ledger
from shardkit.mesh import AXES, make_mesh

Fn = Callable[[jax.Array], jax.Array]

# (mesh shape, collective axis): a 1-D axis of every size, one axis of 2-D meshes, and a tuple
# of axes given against mesh order.
CONFIGS: list[tuple[dict[str, int], coll.Axis]] = [
    ({"model": 1}, "model"),
    ({"model": 2}, "model"),
    ({"model": 3}, "model"),
    ({"model": 4}, "model"),
    ({"model": 8}, "model"),
    ({"data": 2, "model": 4}, "model"),
    ({"data": 2, "model": 4}, "data"),
    ({"data": 4, "model": 2}, "data"),
    ({"data": 2, "model": 3}, ("model", "data")),  # 6 devices, numbered model-major
]


def names(axis: coll.Axis) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else axis


IDS = ["x".join(map(str, s.values())) + "-" + "+".join(names(a)) for s, a in CONFIGS]
INVARIANT_CONFIGS = {0, 2, 5, 8}  # the to="invariant" all-reduces (a ring RS + a built-in AG)
# Values, not speed, are under test here: skipping LLVM's optimisations halves compile time.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.cache
def mesh_of(shape: tuple[tuple[str, int], ...]) -> Mesh:
    return make_mesh(dict(shape))


def config(index: int) -> tuple[Mesh, coll.Axis, int]:
    shape, axis = CONFIGS[index]
    mesh = mesh_of(tuple(shape.items()))
    return mesh, axis, math.prod(mesh.shape[a] for a in names(axis))


def per_device(mesh: Mesh, fn: Callable[..., jax.Array], in_axes: tuple[str, ...] = AXES):
    """shard_map of ``fn``: blocks (leading dim split over ``in_axes``) -> per-device results."""

    def body(*blocks: jax.Array) -> jax.Array:
        return fn(*(b[0] for b in blocks))[None]

    return jax.shard_map(body, mesh=mesh, in_specs=P(in_axes), out_specs=P(AXES))


@dataclasses.dataclass(frozen=True)
class Case:
    """``ours`` must equal ``ref`` on per-device blocks of shape ``block``."""

    name: str
    ours: Fn
    ref: Fn
    block: tuple[int, ...]


class Checker:
    """Compiles every case's forward and gradients (ours and ref) once; ``check`` compares."""

    def __init__(self, mesh: Mesh, axis: coll.Axis, cases: list[Case], outside: bool = True):
        self.mesh, self.cases, self.outside = mesh, cases, outside
        self.outer = tuple(a for a in AXES if a not in names(axis))  # axes x varies over
        self.vma: dict[tuple[str, str], frozenset[str]] = {}
        example = [self.inputs(c, 0) for c in cases]
        self.compiled = jax.jit(self.run).lower(example).compile(FAST_COMPILE)

    def inputs(self, case: Case, seed: int) -> tuple[jax.Array, ...]:
        rng = np.random.default_rng(seed)
        x = rng.integers(-3, 4, size=(self.mesh.size, *case.block), dtype=np.int32)
        out = jax.eval_shape(per_device(self.mesh, case.ref), x)
        w = rng.integers(1, 5, size=out.shape).astype(np.float32)
        replicated = x[: math.prod(self.mesh.shape[a] for a in self.outer)]
        return x, x.astype(np.float32), replicated.astype(np.float32), w

    def typed(self, key: tuple[str, str], fn: Fn) -> Fn:
        def wrapped(b: jax.Array) -> jax.Array:
            y = fn(b)
            self.vma.setdefault(key, jax.typeof(y).mat.varying)
            return y

        return wrapped

    def one(self, fn: Fn, x_int, x, x_rep, w) -> tuple[jax.Array, ...]:
        def inside(b: jax.Array, wb: jax.Array) -> jax.Array:
            return jax.grad(lambda b: jnp.sum(wb * fn(b) ** 3))(b)

        results = per_device(self.mesh, fn)(x_int), per_device(self.mesh, inside)(x, w)
        if not self.outside:
            return results
        replicated = per_device(self.mesh, fn, self.outer)
        return *results, jax.grad(lambda x: jnp.sum(w * replicated(x) ** 3))(x_rep)

    def run(self, inputs: list[tuple[jax.Array, ...]]) -> list[tuple[tuple[jax.Array, ...], ...]]:
        return [
            (
                self.one(self.typed((c.name, "ours"), c.ours), *i),
                self.one(self.typed((c.name, "ref"), c.ref), *i),
            )
            for c, i in zip(self.cases, inputs, strict=True)
        ]

    def check(self, seed: int = 0) -> None:
        results = self.compiled([self.inputs(c, seed) for c in self.cases])
        for case, (ours, ref) in zip(self.cases, results, strict=True):
            names = ("forward", "grad inside", "grad outside")[: len(ours)]
            for what, a, b in zip(names, ours, ref, strict=True):
                assert (a.dtype, a.shape) == (b.dtype, b.shape), (case.name, what)
                np.testing.assert_array_equal(a, b, err_msg=f"{case.name}: {what}")


# ---------------------------------------------------------------------------------------------
# Cases. Blocks are never square; odd blocks make the bidirectional halves unequal (1 + 2).


def gather_cases(axis: coll.Axis, variant: int) -> list[Case]:
    dim, tiled = [(0, True), (1, True), (0, False), (-1, False)][variant % 4]

    def ref(b: jax.Array) -> jax.Array:
        return jax.lax.all_gather(b, axis, axis=dim, tiled=tiled)

    return [
        Case(
            f"{fn.__name__}(axis_dim={dim}, tiled={tiled})",
            functools.partial(fn, axis=axis, axis_dim=dim, tiled=tiled),
            ref,
            (3, 5),
        )
        for fn in (coll.all_gather, coll.ring_all_gather, coll.bidir_all_gather)
    ]


def scatter_cases(axis: coll.Axis, n: int, variant: int) -> list[Case]:
    dim, tiled = [(0, True), (1, True), (0, False), (-1, True)][variant % 4]
    block = [2, 2]
    block[dim] = 3 * n if tiled else n

    def ref(b: jax.Array) -> jax.Array:
        return jax.lax.psum_scatter(b, axis, scatter_dimension=dim % b.ndim, tiled=tiled)

    return [
        Case(
            f"{fn.__name__}(scatter_dim={dim}, tiled={tiled})",
            functools.partial(fn, axis=axis, scatter_dim=dim, tiled=tiled),
            ref,
            tuple(block),
        )
        for fn in (coll.reduce_scatter, coll.ring_reduce_scatter, coll.bidir_reduce_scatter)
    ]


def reduce_cases(axis: coll.Axis, variant: int, invariant: bool) -> list[Case]:
    block = [(3, 5), (), (7,), (2, 1, 3)][variant % 4]  # sizes rarely divisible by n
    tos = ("varying", "invariant") if invariant else ("varying",)

    def ref(b: jax.Array) -> jax.Array:
        return jax.lax.psum(b, axis)

    return [Case("all_reduce", functools.partial(coll.all_reduce, axis=axis), ref, block)] + [
        Case(f"{fn.__name__}(to={to})", functools.partial(fn, axis=axis, to=to), ref, block)
        for fn in (coll.ring_all_reduce, coll.bidir_all_reduce)
        for to in tos
    ]


def move_cases(axis: coll.Axis, n: int) -> list[Case]:
    """all_to_all and ring_shift against the built-ins (tuple-axis shifts: see the test below)."""

    def a2a(b: jax.Array) -> jax.Array:
        return jax.lax.all_to_all(b, axis, 1, 0, tiled=True)

    cases = [
        Case(
            "all_to_all",
            functools.partial(coll.all_to_all, axis=axis, split_axis=-1, concat_axis=0, tiled=True),
            a2a,
            (2, 3 * n),
        )
    ]
    if isinstance(axis, str):
        perm = [(i, (i - 1) % n) for i in range(n)]
        cases.append(
            Case(
                "ring_shift(-1)",
                functools.partial(coll.ring_shift, axis=axis, offset=-1),
                functools.partial(jax.lax.ppermute, axis_name=axis, perm=perm),
                (3, 2),
            )
        )
    return cases


@functools.cache
def config_checker(index: int) -> Checker:
    """Every wrapper and ring / bidirectional variant on ``CONFIGS[index]``, compiled once."""
    mesh, axis, n = config(index)
    cases = (
        gather_cases(axis, index)
        + scatter_cases(axis, n, index)
        + reduce_cases(axis, index, index in INVARIANT_CONFIGS)
        + move_cases(axis, n)
    )
    return Checker(mesh, axis, cases)


# ---------------------------------------------------------------------------------------------
# Equality with the built-ins.


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=IDS)
def test_collectives_equal_builtins(index: int) -> None:
    checker = config_checker(index)
    checker.check(seed=index)
    axes = set(names(CONFIGS[index][1]))
    for case in checker.cases:
        ours, ref = checker.vma[case.name, "ours"], checker.vma[case.name, "ref"]
        if "to=varying" in case.name:
            # Numerically invariant, typed varying: no ppermute proves invariance.
            assert ours == ref | axes, case.name
        else:
            assert ours == ref, case.name


@given(seed=st.integers(0, 2**31 - 1))
def test_collectives_equal_builtins_on_random_data(seed: int) -> None:
    config_checker(5).check(seed)  # reuses the compiled 2x4 (model) checker


@given(
    index=st.integers(0, len(CONFIGS) - 1),
    rows=st.integers(1, 4),
    cols=st.integers(1, 3),
    dim=st.integers(-2, 1),
    tiled=st.booleans(),
)
def test_ring_gather_scatter_any_shape(
    index: int, rows: int, cols: int, dim: int, tiled: bool
) -> None:
    """Any block shape, gather / scatter dim and tiling: ring and bidir == built-in."""
    mesh, axis, n = config(index)
    scattered = [rows, cols]
    scattered[dim] = n * rows if tiled else n

    def ag(b: jax.Array) -> jax.Array:
        return jax.lax.all_gather(b, axis, axis=dim, tiled=tiled)

    def rs(b: jax.Array) -> jax.Array:
        return jax.lax.psum_scatter(b, axis, scatter_dimension=dim % 2, tiled=tiled)

    cases = [
        Case(
            fn.__name__,
            functools.partial(fn, axis=axis, axis_dim=dim, tiled=tiled),
            ag,
            (rows, cols),
        )
        for fn in (coll.ring_all_gather, coll.bidir_all_gather)
    ] + [
        Case(
            fn.__name__,
            functools.partial(fn, axis=axis, scatter_dim=dim, tiled=tiled),
            rs,
            tuple(scattered),
        )
        for fn in (coll.ring_reduce_scatter, coll.bidir_reduce_scatter)
    ]
    Checker(mesh, axis, cases, outside=False).check()


# ---------------------------------------------------------------------------------------------
# Data movement and numbering.


@pytest.mark.parametrize("index", [2, 5, 8], ids=[IDS[i] for i in (2, 5, 8)])
def test_all_to_all_round_trip_and_signature(index: int) -> None:
    """``x[I, J_X] -> x[I_X, J]`` is the identity on the global array; both ways round-trip."""
    mesh, axis, n = config(index)
    x = np.arange(4 * n * 5 * n, dtype=np.int32).reshape(4 * n, 5 * n)

    def there_and_back(b: jax.Array) -> tuple[jax.Array, jax.Array]:
        moved = coll.all_to_all(b, axis, 0, 1, tiled=True)
        stacked = coll.all_to_all(b[:n], axis, 0, 1)  # untiled: dim 0 (n) leaves, dim 1 gets n
        return coll.all_to_all(moved, axis, 1, 0, tiled=True), coll.all_to_all(stacked, axis, 1, 0)

    round_trip = jax.jit(
        jax.shard_map(there_and_back, mesh=mesh, in_specs=P(None, axis), out_specs=P(None, axis))
    )
    tiled, untiled = round_trip(x)
    np.testing.assert_array_equal(tiled, x)
    np.testing.assert_array_equal(untiled, x[:n])
    resplit = jax.shard_map(
        lambda b: coll.all_to_all(b, axis, 0, 1, tiled=True),
        mesh=mesh,
        in_specs=P(None, axis),
        out_specs=P(axis, None),
    )
    np.testing.assert_array_equal(jax.jit(resplit)(x), x)


def test_tuple_axes_number_devices_in_the_order_given() -> None:
    mesh, axis, n = config(8)  # ("model", "data") on data=2 x model=3

    def body(_: jax.Array) -> jax.Array:
        index = coll.axis_index(axis)
        expected = coll.axis_index("model") * 2 + coll.axis_index("data")
        moved = [coll.ring_shift(index, axis, k) for k in (1, -1, 2)]
        partial = coll.permute(index, axis, [(0, 5), (5, 0)])  # the others receive zeros
        gathered = coll.all_gather(index, axis)
        rows = [index, expected, *moved, partial, jnp.int32(coll.axis_size(axis))]
        return jnp.concatenate([jnp.stack(rows), gathered])

    out = np.asarray(per_device(mesh, body)(np.zeros((mesh.size,), np.float32)))
    index = out[:, 0]
    np.testing.assert_array_equal(index, out[:, 1])
    for col, k in zip((2, 3, 4), (1, -1, 2), strict=True):
        np.testing.assert_array_equal(out[:, col], (index - k) % n)
    np.testing.assert_array_equal(out[:, 5], np.select([index == 0, index == 5], [5, 0], 0))
    assert (out[:, 6] == n).all() and (out[:, 7:] == np.arange(n)).all()


def test_bad_scatter_sizes_fail_with_one_sentence() -> None:
    mesh, axis, _ = config(3)
    for fn in (coll.ring_reduce_scatter, coll.bidir_reduce_scatter):
        with pytest.raises(ValueError, match=r"dim 0 \(6\) divisible by 4"):
            per_device(mesh, functools.partial(fn, axis=axis, tiled=True))(np.zeros((4, 6, 2)))
    with pytest.raises(ValueError, match=r"to must be"):
        per_device(mesh, functools.partial(coll.ring_all_reduce, axis=axis, to="both"))(
            np.zeros((4, 2))
        )


# ---------------------------------------------------------------------------------------------
# Compiled HLO: what moves.

_COLLECTIVE = re.compile(
    r"= (.+?) (collective-permute|all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\("
)


def collectives(hlo: str) -> dict[str, list[int]]:
    """Kind -> element counts of each collective's result(s) in compiled HLO text."""
    found: dict[str, list[int]] = {}
    for shapes, kind in _COLLECTIVE.findall(hlo):
        dims = re.findall(r"\w+\[([\d,]*)\]", shapes)
        elements = sum(math.prod(int(d) for d in s.split(",") if d) for s in dims)
        found.setdefault(kind, []).append(elements)
    return found


def test_rings_compile_to_collective_permutes_only() -> None:
    mesh, axis, n = config(5)  # model=4 inside data=2
    block = (2 * n, 3)  # 2 rows per block: the bidirectional halves are 1 row each
    tiled = {"tiled": True}
    expected_steps = [  # ring steps forward (the backward runs as many again)
        (coll.ring_all_gather, tiled, n - 1),
        (coll.bidir_all_gather, tiled, 2 * (n - 1)),
        (coll.ring_reduce_scatter, tiled, n - 1),
        (coll.bidir_reduce_scatter, tiled, 2 * (n - 1)),
        (coll.ring_all_reduce, {}, 2 * (n - 1)),
        (coll.bidir_all_reduce, {}, 4 * (n - 1)),
    ]
    for fn, kwargs, steps in expected_steps:
        sharded = per_device(mesh, functools.partial(fn, axis=axis, **kwargs))
        loss = jax.grad(lambda x, f=sharded: jnp.sum(f(x) ** 3))
        hlo = jax.jit(loss).lower(np.ones((mesh.size, *block), np.float32)).compile().as_text()
        assert collectives(hlo).keys() == {"collective-permute"}, (fn.__name__, hlo)
        assert len(collectives(hlo)["collective-permute"]) == 2 * steps, fn.__name__


@pytest.mark.parametrize(
    "shape, axis",
    [({"model": 2}, "model"), ({"model": 8}, "model"), ({"data": 4, "model": 2}, "data"),
     ({"data": 2, "model": 4}, ("model", "data"))],
    ids=["2", "8", "4 of 4x2", "model+data"],
)  # fmt: skip
def test_halving_reduce_scatter_is_the_reduce_scatter_in_log_n_exchanges(shape, axis) -> None:
    """Recursive halving: psum_scatter's values and gradient, in log2(n) exchanges forward
    (device i with i XOR d) and as many backward, (n − 1)/n · V sent, as a ring's."""
    mesh = mesh_of(tuple(shape.items()))
    n = math.prod(mesh.shape[a] for a in names(axis))
    ours = per_device(mesh, functools.partial(coll.halving_reduce_scatter, axis=axis))
    ref = per_device(mesh, lambda b: jax.lax.psum_scatter(b, axis, scatter_dimension=0))
    x = np.random.default_rng(0).normal(size=(mesh.size, n, 3, 2)).astype(np.float32)
    loss = lambda f: jax.jit(jax.value_and_grad(lambda x: jnp.sum(jnp.sin(f(x)))))  # noqa: E731
    testing.assert_trees_close(loss(ours)(x), loss(ref)(x), 1e-6)
    led = ledger.measure(loss(ours), x, mesh=mesh)
    hops = [c for c in led.collectives if c.kind == "collective-permute"]
    assert sum(c.count for c in hops) == 2 * (n.bit_length() - 1)
    assert sum(c.total_bytes_sent for c in hops) == 2 * (n - 1) * 3 * 2 * 4


def test_halving_reduce_scatter_needs_a_power_of_two() -> None:
    mesh = mesh_of((("model", 3),))
    fn = per_device(mesh, functools.partial(coll.halving_reduce_scatter, axis="model"))
    with pytest.raises(ValueError, match="needs a power-of-two axis and dim 0 equal to it, got 3"):
        jax.eval_shape(fn, np.ones((3, 3, 2), np.float32))


def test_invariant_ring_all_reduce_has_psums_free_backward() -> None:
    """to="invariant": ring reduce-scatter + one built-in all-gather; backward sends nothing."""
    mesh, axis, n = config(5)
    ours = functools.partial(coll.ring_all_reduce, axis=axis, to="invariant")

    def grad_inside(b: jax.Array) -> jax.Array:
        return jax.grad(lambda b: jnp.sum(jnp.tanh(ours(b))))(b)

    x = np.ones((mesh.size, 4 * n, 3), np.float32)
    found = collectives(jax.jit(per_device(mesh, grad_inside)).lower(x).compile().as_text())
    assert {k: len(v) for k, v in found.items()} == {"collective-permute": n - 1, "all-gather": 1}


# ---------------------------------------------------------------------------------------------
# Megatron f and g.


def test_megatron_f_is_identity_forward_psum_backward() -> None:
    mesh, axis, n = config(5)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    w = np.arange(1, 2 * n * 3 + 1, dtype=np.float32).reshape(2 * n, 3)  # w[D_model, 3]

    def body(x: jax.Array, w_frag: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = coll.megatron_f(x, axis) * w_frag[:2]
        return y, jax.grad(lambda x: jnp.sum(coll.megatron_f(x, axis) * w_frag[:2]))(x)

    run = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis)), out_specs=(P(axis), P()))
    y, dx = run(x, w)
    frags = w.reshape(n, 2, 3)
    np.testing.assert_array_equal(y, (x * frags).reshape(2 * n, 3))
    np.testing.assert_array_equal(dx, frags.sum(axis=0))  # the psum of every device's cotangent


def test_megatron_g_is_psum_forward_identity_backward() -> None:
    mesh, axis, n = config(5)
    parts = np.arange(n * 2 * 3, dtype=np.float32).reshape(n * 2, 3)  # p[B, D]{U_model}, stacked
    v = np.array([[1.0, -2.0, 3.0], [0.5, 4.0, -1.0]], np.float32)

    def body(p: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        return coll.megatron_g(p, axis), jax.grad(lambda p: jnp.sum(coll.megatron_g(p, axis) * v))(
            p
        )

    run = jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P()), out_specs=(P(), P(axis)))
    total, dp = run(parts, v)
    np.testing.assert_array_equal(total, parts.reshape(n, 2, 3).sum(axis=0))
    np.testing.assert_array_equal(dp, np.tile(v, (n, 1)))  # identity on every device


def mlp_tp(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
    """``x[B_data, D] · W1[D, F_model] -> h[B_data, F_model] · W2[F_model, D] -> y{U_model}``."""
    h = jnp.tanh(coll.megatron_f(x, "model") @ w1)
    return coll.megatron_g(h @ w2, "model")


def mlp_ref(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
    return jnp.tanh(x @ w1) @ w2


def test_megatron_mlp_matches_unsharded() -> None:
    mesh, _, _ = config(5)
    rng = np.random.default_rng(0)
    args = [rng.normal(size=s).astype(np.float32) for s in ((4, 6), (6, 8), (8, 6))]
    specs = (P("data"), P(None, "model"), P("model", None))

    def loss_tp(x, w1, w2):
        return jnp.sum(
            jax.shard_map(mlp_tp, mesh=mesh, in_specs=specs, out_specs=P("data"))(x, w1, w2) ** 2
        )

    def dx_inside(x, w1, w2):  # x invariant over model: f's psum makes dx whole on each device
        return jax.grad(lambda x: jnp.sum(mlp_tp(x, w1, w2) ** 2))(x)

    def loss_ref(x, w1, w2):
        return jnp.sum(mlp_ref(x, w1, w2) ** 2)

    grads = jax.jit(jax.grad(loss_tp, argnums=(0, 1, 2)))(*args)
    dx = jax.jit(jax.shard_map(dx_inside, mesh=mesh, in_specs=specs, out_specs=P("data")))(*args)
    np.testing.assert_allclose(loss_tp(*args), loss_ref(*args), rtol=1e-5)
    for got, want in zip(
        (*grads, dx),
        (*jax.grad(loss_ref, argnums=(0, 1, 2))(*args), jax.grad(loss_ref)(*args)),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_megatron_f_sums_three_cotangents_before_one_all_reduce() -> None:
    """Without f, x's three uses all-reduce three cotangents; with f, one (a third the bytes)."""
    mesh, _, _ = config(5)
    specs = (P("data"), *[P(None, "model")] * 3)
    args = [np.ones((4, 6), np.float32)] + [np.ones((6, 8), np.float32)] * 3

    def backward_all_reduce_elements(use_f: bool) -> int:
        def loss(x, wq, wk, wv):
            h = coll.megatron_f(x, "model") if use_f else x
            scores = jnp.sum(jnp.tanh(h @ wq) * (h @ wk) * (h @ wv), axis=1)
            return jnp.sum(coll.megatron_g(scores, "model") ** 2)

        run = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=specs, out_specs=P("data"))
        found = collectives(jax.jit(run).lower(*args).compile().as_text())["all-reduce"]
        return sum(found) - 2  # less the forward g of the scores (2 per device)

    assert backward_all_reduce_elements(False) == 3 * 2 * 6
    assert backward_all_reduce_elements(True) == 2 * 6


def test_megatron_f_and_g_reject_the_wrong_vma_type() -> None:
    mesh, axis, _ = config(5)
    with pytest.raises(ValueError, match="megatron_f needs an invariant value over 'model'"):
        per_device(mesh, lambda b: coll.megatron_f(b, axis))(np.zeros((8, 2), np.float32))
    with pytest.raises(ValueError, match="megatron_g needs a varying partial sum over 'model'"):
        jax.shard_map(lambda b: coll.megatron_g(b, axis), mesh=mesh, in_specs=P(), out_specs=P())(
            np.zeros(2, np.float32)
        )


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda x: coll.all_reduce(x, "model"), "collectives.all_reduce"),
        (lambda x: coll.ring_all_gather(x, "seq"), "collectives.ring_all_gather"),
        (lambda x: shardkit.tensor.enter_tp(x, "model"), "tensor.enter_tp"),  # names the outer
        (lambda x: shardkit.data.vary({"w": x}, {"w": ("data",)}), "data.vary"),
    ],
)
def test_primitives_name_themselves_outside_shard_map(call, name) -> None:
    want = rf"^shardkit\.{re.escape(name)} must run inside jax\.shard_map, on a mesh that has "
    with pytest.raises(coll.OutsideShardMapError, match=want + r"every axis it is given \("):
        call(jnp.ones((2, 4)))


def test_an_axis_the_mesh_lacks_is_named() -> None:
    mesh = make_mesh({"data": 2})
    body = lambda x: coll.all_reduce(x, "pipe")  # noqa: E731
    fn = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P())
    with pytest.raises(coll.OutsideShardMapError, match=r"all_reduce .*no axis 'pipe'; its axes"):
        fn(jnp.ones((2, 4)))
