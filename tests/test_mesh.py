"""shardkit.mesh: meshes, mesh specs and the Plan's own rules, each broken rule one sentence."""

from __future__ import annotations

from typing import Any

import jax
import pytest

from shardkit.mesh import Plan, PlanError, format_mesh, make_mesh, parse_mesh


def assert_one_sentence(err: Exception) -> None:
    message = str(err)
    assert "\n" not in message and message.endswith(".") and ". " not in message, message


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: make_mesh({"data": 4, "model": 4}),
            "data=4,seq=1,model=4 needs 16 devices but only 8 are available",
        ),
        (lambda: make_mesh({"data": 3, "seq": 3}), "needs 9 devices but only 8"),
        (
            lambda: make_mesh({"pipe": 2}),
            "Unknown mesh axis 'pipe'; axes are data, stage, expert, seq, model",
        ),
        (
            lambda: parse_mesh("data=2,pipe=2"),
            "Unknown mesh axis 'pipe'; axes are data, stage, expert, seq, model",
        ),
        (lambda: Plan({"pipe": 2}), "Unknown mesh axis 'pipe'"),
        (
            lambda: parse_mesh("data2"),
            "Mesh entry 'data2' is not of the form axis=positive_integer",
        ),
        (lambda: parse_mesh("data=0"), "Mesh entry 'data=0' is not of the form"),
        (lambda: Plan({"data": 0}), "Mesh axis data must have a positive integer size, got 0"),
        (lambda: Plan(sp="zigzag"), "Unknown sp mode 'zigzag'; choose one of none, megatron"),
        (lambda: Plan(pp="dualpipe"), "Unknown pipeline schedule 'dualpipe'; choose one of none"),
        (lambda: Plan(microbatches=0), "--microbatches must be a positive integer, got 0"),
        (lambda: Plan(virtual=-1), "--virtual must be a positive integer, got -1"),
        (lambda: Plan(kernel="cuda"), "Unknown kernel 'cuda'; choose one of auto, jnp, pallas"),
        (lambda: Plan(grad_sync="fp8"), "Unknown --grad-sync 'fp8'; choose one of float32, bf"),
        (
            lambda: Plan({"data": 2}, zero=1, overlap=True),
            "--overlap hides Megatron-SP's collective matmuls, plain TP's all-reduces, FSDP's "
            r"gathers and scatters, ZeRO-2's and DP's per-layer gradient syncs \(ZeRO-1 "
            r"reduce-scatters once after backward: use --zero 2\); this plan has none of them\.",
        ),
        (
            lambda: Plan({"model": 2}, sp="megatron", overlap=True, remat="dots"),
            "--overlap is not built yet with --remat or --pp",
        ),
        # The rules that need no model: the Plan checks them when it is built.
        (
            lambda: Plan({"seq": 2}),
            "sp='none' does not split tokens over seq, but the mesh has seq=2",
        ),
        (lambda: Plan({"stage": 2}), "The mesh has stage=2 but no pipeline schedule; give --pp"),
        (
            lambda: Plan({"data": 2}, fsdp=True, microbatches=2),
            "--zero 3 would gather or scatter the params once per micro-batch",
        ),
        (
            lambda: Plan({"data": 2, "model": 2}, overlap="bidirectional"),
            "--overlap bidirectional runs Megatron-SP's collective matmuls both ways",
        ),
        (lambda: Plan({"data": 2}, overlap="both"), "--overlap takes no value or 'bidirectional'"),
        (
            lambda: Plan({"data": 2}, overlap=True, microbatches=2),
            "--overlap's layer-by-layer gradient sync would run once per micro-batch",
        ),
        (lambda: Plan({"data": 2}, virtual=2), "--virtual 2 only applies with --pp interleaved"),
        (
            lambda: Plan({"stage": 2}, pp="gpipe", layers="list"),
            "--layers list keeps each layer's params in their own arrays, and --pp gpipe cuts",
        ),
        (
            lambda: Plan({"data": 2}, pp="1f1b"),
            r"--pp 1f1b needs a stage axis of size > 1 in --mesh",
        ),
        (
            lambda: Plan({"stage": 2}, pp="gpipe", virtual=2),
            "--virtual 2 only applies to --pp interleaved, not --pp gpipe",
        ),
        (
            lambda: Plan({"data": 2}, sp="megatron"),
            "'megatron' splits tokens over the model axis, but the mesh has model=1",
        ),
        (
            lambda: Plan({"data": 2}, sp="ring"),
            "sp='ring' splits tokens over the seq axis, but the mesh has seq=1",
        ),
        (
            lambda: Plan({"seq": 2}, sp="ring", ulysses=2),
            "--ulysses 2 only applies to sp='usp' or 'megatron', not sp='ring'",
        ),
        (
            lambda: Plan({"model": 2}, sp="megatron", ulysses=2),
            "--ulysses 2 with sp='megatron' splits the seq axis, but the mesh has seq=1",
        ),
        (lambda: Plan({"model": 2}, zero=1), "--zero 1 splits over data, but the mesh has data=1"),
        (lambda: Plan(layers="loop"), "Unknown layers 'loop'; choose one of scan, unrolled"),
        (
            lambda: Plan({"data": 2, "stage": 2}, zero=2, pp="1f1b", microbatches=2),
            "--zero 2 cannot run under --pp 1f1b",
        ),
    ],
)
def test_mesh_and_plan_errors(make: Any, match: str) -> None:
    with pytest.raises(PlanError, match=match) as err:
        make()
    assert_one_sentence(err.value)


def test_parse_mesh_fills_omitted_axes() -> None:
    ones = {"data": 1, "stage": 1, "expert": 1, "seq": 1, "model": 1}
    assert parse_mesh("model=4, data=2") == {**ones, "data": 2, "model": 4}
    assert parse_mesh("") == ones
    assert Plan({"model": 2}).mesh == {**ones, "model": 2}
    # stage and expert named only when > 1
    assert format_mesh(parse_mesh("model=4")) == "data=1,seq=1,model=4"
    assert format_mesh(parse_mesh("stage=2,model=4")) == "data=1,stage=2,seq=1,model=4"
    assert format_mesh(parse_mesh("expert=2,model=4")) == "data=1,expert=2,seq=1,model=4"
    assert dict(make_mesh({"seq": 2}).shape) == {**ones, "seq": 2}


def test_zero_and_fsdp_are_one_setting() -> None:
    assert Plan({"data": 2}, fsdp=True).zero == 3
    assert Plan({"data": 2}, zero=3).fsdp is True
    with pytest.raises(PlanError, match="--fsdp is ZeRO-3 but --zero 1 was asked for"):
        Plan({"data": 2}, fsdp=True, zero=1)
    with pytest.raises(PlanError, match="--zero must be one of 0, 1, 2, 3, got 4"):
        Plan(zero=4)


def test_plan_sizes_and_devices() -> None:
    plan = Plan({"data": 2, "model": 3})
    assert plan.num_devices == 6
    assert (plan.size("data"), plan.size("stage"), plan.size("seq")) == (2, 1, 1)
    assert len(jax.devices()) >= plan.num_devices
