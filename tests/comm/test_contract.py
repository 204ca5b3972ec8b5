"""Contracts for any program (``shardkit.comm.contract``): declared collectives, checked against
the compiled HLO, with a readable diff when they differ."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardkit.comm import contract
from shardkit.mesh import make_mesh
from shardkit.parallel import data as dp

MESH = make_mesh({"data": 4, "model": 2})


def test_helpers_use_the_ring_formulas() -> None:
    assert contract.all_reduce("data", 800, 4).bytes_sent == 1200
    assert contract.all_gather(("data", "model"), 800, 8, count=3).bytes_sent == 3 * 700
    assert contract.reduce_scatter("model", 800, 2).bytes_sent == 400
    assert contract.all_to_all("seq", 800, 4).bytes_sent == 600
    assert contract.permute("seq", 800, count=2) == contract.Expected(
        "collective-permute", ("seq",), 2, 1600, pattern="shift +1"
    )


def _row_sum():
    """x[B_data, D_model] -> psum over model of the row sums: one all-reduce of [B/4] floats."""
    body = lambda x: jax.lax.psum(x.sum(axis=1), "model")  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("data", "model"), out_specs=P("data")))


X = jax.device_put(np.ones((8, 6), np.float32), NamedSharding(MESH, P("data", "model")))


def test_a_declared_program_holds() -> None:
    expected = [contract.all_reduce("model", 2 * 4, 2, why="row sums")]  # [B/4 = 2] float32
    ledger = contract.assert_contract(_row_sum(), X, expected=expected)
    assert contract.differences(ledger, expected) == []


def test_a_stray_collective_and_wrong_bytes_are_listed() -> None:
    sharded_whole = jax.device_put(np.ones((8, 6), np.float32), NamedSharding(MESH, P("data")))

    def stray(x, w):  # w arrives split over data, but the body reads it whole: XLA gathers it
        inner = lambda x: jax.lax.psum(x.sum(axis=1), "model") + w.sum()  # noqa: E731
        return jax.shard_map(inner, mesh=MESH, in_specs=P("data", "model"), out_specs=P("data"))(x)

    declared = [contract.all_reduce("model", 2 * 4, 2)]
    with pytest.raises(AssertionError) as err:
        contract.assert_contract(jax.jit(stray), X, sharded_whole, expected=declared)
    text = str(err.value)
    assert text.startswith("communication contract broken:")
    assert "all-gather over data: 1 ops measured, 0 expected." in text
    assert "✗" in text and "✓" in text  # the table marks each row
    wrong = [contract.all_reduce("model", 4 * 4, 2)]  # declared twice the bytes
    message = r"all-reduce over model: 8 bytes measured, 16 expected"
    with pytest.raises(AssertionError, match=message):
        contract.assert_contract(_row_sum(), X, expected=wrong)


def _token_sharded_grads(sync_axes: tuple[str, ...]):
    """w used on x[B_data, T_seq]: its gradient is a partial sum over data AND seq."""
    mesh = make_mesh({"data": 2, "seq": 2})
    axes = {"w": sync_axes}

    def body(p, x):
        def loss(p):
            return jnp.sum(jnp.tanh(x @ p["w"]))

        grads = jax.grad(loss)(dp.vary(p, axes))
        return dp.sync_grads(grads, axes)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data", "seq")), out_specs=P()))
    return fn, mesh


def test_a_forgotten_sync_axis_fails_no_implicit_collectives() -> None:
    """The second silent mistake: sync over data but not seq. Values stay right (autodiff sums
    over seq itself), but that sum is an implicit all-reduce the contract refuses."""
    params = {"w": np.ones((3, 2), np.float32)}
    x = np.ones((4, 6, 3), np.float32)
    good, mesh = _token_sharded_grads(("data", "seq"))
    ledger = contract.assert_contract(
        good, params, x, expected=[contract.all_reduce(("data", "seq"), 6 * 4, 4)], mesh=mesh
    )
    assert {c.origin for c in ledger.collectives} == {"written"}
    bad, _ = _token_sharded_grads(("data",))
    with pytest.raises(AssertionError) as err:
        contract.assert_contract(
            bad, params, x, expected=[contract.all_reduce("data", 6 * 4, 2)], mesh=mesh
        )
    assert "implicit all-reduce over seq: autodiff's transpose of a check_vma implicit cast " in (
        str(err.value)
    )
    assert "test_contract.py:" in str(err.value)  # the source line of the implicit broadcast
    lenient = contract.assert_contract(
        bad, params, x, mesh=mesh, implicit_ok=True,
        expected=[contract.all_reduce("data", 6 * 4, 2), contract.all_reduce("seq", 6 * 4, 2)],
    )  # fmt: skip
    assert [c.origin for c in lenient.implicit()] == ["implicit"]


def test_the_sharded_vits_steps_have_no_implicit_collectives() -> None:
    import vit_ref
    from shardkit.mesh import Plan
    from shardkit.models.vit import report

    cfg = vit_ref.ViTConfig(
        image=8, patch=2, channels=1, classes=10, dim=32, depth=2, heads=4, mlp_dim=64,
        pool="tok", head_zeroinit=False,
    )  # fmt: skip
    plans = [Plan({"data": 4, "model": 2}), Plan({"data": 2, "seq": 2, "model": 2}, sp="ring",
             fsdp=True), Plan({"data": 2, "seq": 4}, sp="ulysses")]  # fmt: skip
    for plan in plans:
        ledger = report.inspect(cfg, plan, 8).ledger
        assert ledger.implicit() == [], (plan, ledger.implicit())
        assert {c.origin for c in ledger.collectives} <= {"written", "transpose"}
