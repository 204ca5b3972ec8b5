"""Pattern contracts: a collective must move its bytes the way its docstring says.

Every claim ``shardkit.parallel.collectives`` and the ring attention make about direction, link
use or axis, held to the compiled HLO with ``comm.contract`` (whose patterns come from
``comm.ledger.pattern_of``): the ring collectives hop i -> i + 1, the bidirectional ones carry
half their bytes each way, ``ring_shift`` shifts by its offset, the ring attention's K, V and
dK, dV all travel +1. And the three wrong ways to move the right bytes each fail, naming the op
and both patterns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardkit.comm import contract, ledger
from shardkit.mesh import make_mesh
from shardkit.parallel import collectives as coll
from shardkit.parallel import sequence

MESH = make_mesh({"seq": 4, "model": 2})
N = 4
W = 4  # float32


def _on_seq(body: Callable[[jax.Array], jax.Array], rows: int = 2, cols: int = 4) -> Any:
    """(jitted fn, its input): body on x[R_seq, C] blocks of [rows, cols] float32 (the output
    laid out over seq and model, so a body may also move blocks over model)."""
    out = P(("seq", "model"))
    fn = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("seq"), out_specs=out, check_vma=False))
    x = np.arange(N * rows * cols, dtype=np.float32).reshape(N * rows, cols)
    return fn, jax.device_put(x, NamedSharding(MESH, P("seq")))


def _ring(step: int, block: float, count: int = N - 1) -> contract.Expected:
    return contract.permute("seq", block, count=count, step=step, n=N)


def _bidir(block: float) -> list[contract.Expected]:
    """Half of every block clockwise, half counter-clockwise."""
    return [_ring(+1, block / 2), _ring(-1, block / 2)]


BLOCK = 2 * 4 * W  # one device's [2, 4] float32 block
CLAIMS = {
    # docstring: "n-1 ring steps (device i -> i+1) ... one link direction carries it all"
    "ring_all_gather": (lambda x: coll.ring_all_gather(x, "seq", tiled=True), [_ring(1, BLOCK)]),
    # "n-1 ring steps" (i -> i + 1) on an input of n blocks
    "ring_reduce_scatter": (
        lambda x: coll.ring_reduce_scatter(jnp.tile(x, (N, 1)), "seq", tiled=True),
        [_ring(1, BLOCK)],
    ),
    # a ring reduce-scatter then a ring all-gather of the n-padded flat x: 2(n-1) hops of V/n
    "ring_all_reduce": (lambda x: coll.ring_all_reduce(x, "seq"), [_ring(1, BLOCK / N, 2 * 3)]),
    # "the first half of each block goes clockwise, the second half counter-clockwise"
    "bidir_all_gather": (lambda x: coll.bidir_all_gather(x, "seq", tiled=True), _bidir(BLOCK)),
    "bidir_reduce_scatter": (
        lambda x: coll.bidir_reduce_scatter(jnp.tile(x, (N, 1)), "seq", tiled=True),
        _bidir(BLOCK),
    ),
    "bidir_all_reduce": (
        lambda x: coll.bidir_all_reduce(x, "seq"),
        [_ring(1, BLOCK / N / 2, 6), _ring(-1, BLOCK / N / 2, 6)],
    ),
    # "from device i to device (i + offset) mod n"
    "ring_shift(+1)": (lambda x: coll.ring_shift(x, "seq"), [_ring(1, BLOCK, 1)]),
    "ring_shift(-1)": (lambda x: coll.ring_shift(x, "seq", -1), [_ring(-1, BLOCK, 1)]),
    "ring_shift(+2)": (lambda x: coll.ring_shift(x, "seq", 2), [_ring(2, BLOCK, 1)]),
}


@pytest.mark.parametrize("name", list(CLAIMS))
def test_each_ring_collective_moves_its_bytes_the_way_its_docstring_says(name: str) -> None:
    body, expected = CLAIMS[name]
    fn, x = _on_seq(body)
    contract.assert_contract(fn, x, expected=expected)


def test_on_two_devices_plus_and_minus_one_are_the_same_permutation() -> None:
    fn = jax.jit(
        jax.shard_map(lambda x: coll.ring_shift(x, "model", -1), mesh=MESH,
                      in_specs=P("model"), out_specs=P("model"))
    )  # fmt: skip
    x = jax.device_put(np.ones((4, 4), np.float32), NamedSharding(MESH, P("model")))
    declared = [contract.permute("model", 2 * 4 * W, step=-1, n=2)]
    led = contract.assert_contract(fn, x, expected=declared)
    assert [c.pattern for c in led.collectives] == ["shift +1"]


def test_ring_attention_sends_every_block_and_accumulator_plus_one() -> None:
    """ring.py: K, V visit i -> i + 1 (r−1 hops each, forward and again backward); the dK, dV
    accumulators travel the same way, r hops home. One 2-head block: b·t·h·k floats."""
    b, t, h, k = 1, 3, 2, 4
    spec = P(None, "seq")

    def loss(q, kk, v):
        out, _ = sequence.attention_ring(q, kk, v, axis="seq")
        return jnp.sum(jnp.sin(out))[None]

    fn = jax.shard_map(loss, mesh=MESH, in_specs=(spec,) * 3, out_specs=P("seq"))
    grad = jax.jit(jax.grad(lambda *a: fn(*a).sum(), argnums=(0, 1, 2)))
    rng = np.random.default_rng(0)
    qkv = [
        jax.device_put(rng.standard_normal((b, N * t, h, k)).astype(np.float32),
                       NamedSharding(MESH, spec))
        for _ in range(3)
    ]  # fmt: skip
    e = b * t * h * k * W
    expected = [
        _ring(1, e, 2 * (N - 1)),  # K, V forward
        _ring(1, e, 2 * (N - 1)),  # K, V again in backward
        _ring(1, e, 2 * N),  # dK, dV home
    ]
    contract.assert_contract(grad, *qkv, expected=expected)


# ----------------------------------------------------------------------------- wrong patterns


def _one_way_bidir_all_gather(x: jax.Array) -> jax.Array:
    """Claims bidirectional, sends both halves clockwise: right bytes, one link direction."""
    row = x.reshape(1, -1)
    half = row.shape[1] // 2
    halves = [coll._ring_gather(row[:, :half], "seq", 0, 1),
              coll._ring_gather(row[:, half:], "seq", 0, 1)]  # fmt: skip
    return jnp.concatenate(halves, axis=1).reshape(-1, x.shape[1])


def _minus_one_ring_all_gather(x: jax.Array) -> jax.Array:
    """A ring all-gather hopping i -> i − 1 where +1 is declared."""
    return coll._ring_gather(x, "seq", 0, -1)


WRONG = {
    "all blocks one way in a bidirectional ring": (
        _one_way_bidir_all_gather,
        _bidir(BLOCK),
        "collective-permute over seq: expected pattern shift +1: 3 ops, 48 B; shift -1: 3 ops, "
        "48 B, measured shift +1: 6 ops, 96 B",
    ),
    "a -1 ring where +1 is claimed": (
        _minus_one_ring_all_gather,
        [_ring(1, BLOCK)],
        "collective-permute over seq: expected pattern shift +1: 3 ops, 96 B, measured "
        "shift -1: 3 ops, 96 B (ppermute",
    ),
    "a permute over the wrong axis": (
        lambda x: coll.ring_shift(x, "model"),  # its output varies over model too: see _on_seq
        [_ring(1, BLOCK, 1)],
        "collective-permute over model: 1 ops measured, 0 expected.",
    ),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_the_right_bytes_moved_the_wrong_way_fail_the_contract(case: str) -> None:
    body, declared, message = WRONG[case]
    fn, x = _on_seq(body)
    with pytest.raises(AssertionError, match="communication contract broken") as err:
        contract.assert_contract(fn, x, expected=declared)
    assert message in str(err.value)


def test_the_one_way_ring_computes_the_right_result() -> None:
    """The wrong-pattern programs are right in value: only their pattern gives them away."""
    for body in (_one_way_bidir_all_gather, _minus_one_ring_all_gather):
        fn, x = _on_seq(body)
        want, _ = _on_seq(lambda x: jax.lax.all_gather(x, "seq", tiled=True))
        np.testing.assert_array_equal(fn(x), want(x))


# ----------------------------------------------------------------------------- the ledger


@functools.cache
def _square_mesh() -> Any:
    return make_mesh({"data": 2, "model": 2})


def test_pattern_of_names_axis_groups_shifts_and_anything_else_explicitly() -> None:
    mesh = _square_mesh()  # devices 0..3 at (data, model) = (0,0) (0,1) (1,0) (1,1)
    assert ledger.pattern_of(((0, 1), (2, 3)), (), ("model",), mesh) == ledger.GROUPS
    assert ledger.pattern_of(((0, 2), (1, 3)), (), ("data",), mesh) == ledger.GROUPS
    assert ledger.pattern_of(((0, 3), (1, 2)), (), ("data", "model"), mesh) == "groups {0,3} {1,2}"
    assert ledger.pattern_of((), ((0, 1), (2, 3)), ("model",), mesh) == "shift +1"
    ring = ((0, 1), (1, 2), (2, 3), (3, 0))  # linear over (data, model)
    assert ledger.pattern_of((), ring, ("data", "model"), mesh) == "shift +1"
    back = tuple((t, s) for s, t in ring)
    assert ledger.pattern_of((), back, ("data", "model"), mesh) == "shift -1"
    assert ledger.pattern_of((), ((0, 1), (1, 3)), ("data", "model"), mesh) == "pairs 0>1 1>3"
    assert ledger.shift(3, 4) == "shift -1" and ledger.shift(2, 4) == "shift +2"


def test_link_bytes_show_each_direction_of_each_link() -> None:
    """What ``inspect --plot`` draws per link: a bidirectional ring loads i → i+1 and i+1 → i
    alike; the one-way version of the same bytes loads one direction twice and leaves the other
    idle."""
    from shardkit.comm.plot import link_bytes

    both = link_bytes(contract.measure(*_on_seq(CLAIMS["bidir_all_gather"][0])), MESH.size)
    one = link_bytes(contract.measure(*_on_seq(_one_way_bidir_all_gather)), MESH.size)
    half = (N - 1) * BLOCK / 2  # each direction of a ring link: n−1 hops of half a block
    assert {(i, j): (f, b) for i, j, f, b in both} == {
        (0, 2): (half, half), (2, 4): (half, half), (4, 6): (half, half), (0, 6): (half, half),
        (1, 3): (half, half), (3, 5): (half, half), (5, 7): (half, half), (1, 7): (half, half),
    }  # fmt: skip
    assert sorted((f, b) for *_, f, b in one) == [(0.0, 2 * half)] * 2 + [(2 * half, 0.0)] * 6
