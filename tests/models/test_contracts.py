"""Communication contracts: every compiled train step sends exactly what shardkit.cost says.

For compositions beyond ``shardkit.verify.default_matrix()`` (whose every strategy
``tests/run/test_cli.py::test_verify_default_matrix_passes`` holds to its contract through
``shardkit verify``) the full train step (forward, backward, AdamW update) is compiled — never
run — and its ledger must equal the analytic expectation: the same op count per (kind, axes),
bytes within 1%, and the same patterns.
Then the check is shown to bite: a stray all-gather (a closed-over sharded array) or an extra
psum fails it, and naive autodiff over separate q, k, v projections sends the bytes DESIGN.md
measured (22.47 MB) against the 18.21 MB minimum that ShardedViT meets.

Compiles are shared through a module cache; the file takes 1–2 minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import shardkit.models.vit.model
import shardkit.parallel.tensor
import vit_ref
from shardkit.comm.ledger import Ledger, measure, parse_hlo
from shardkit.mesh import Plan, make_mesh
from shardkit.models.vit import ShardedViT, cost, report
from shardkit.run import bench
from shardkit.run.verify import default_matrix
from vit_ref.train import apply_optimizer

CFG = vit_ref.ViTConfig(
    image=32, patch=4, classes=10, dim=64, depth=2, heads=8, mlp_dim=128, pool="tok"
)
GAP = dataclasses.replace(CFG, pool="gap")  # 64 tokens: no padding on any shard count here
BATCH = 16
ANCHOR = vit_ref.ViTConfig(
    image=32, patch=4, classes=10, dim=256, depth=4, heads=4, mlp_dim=1024, pool="tok"
)
ANCHOR_BATCH = 32
MB = 1e6

MATRIX = {case.name: (CFG, case.plan) for case in default_matrix()}
COMPOSITIONS = {
    "ring remat, gap (unpadded, r=4)": (GAP, Plan({"data": 2, "seq": 4}, sp="ring", remat=True)),
    "2×2×2 Ulysses+TP remat (padded)": (
        CFG,
        Plan({"data": 2, "seq": 2, "model": 2}, sp="ulysses", remat=True),
    ),
    "USP ring 4 × Ulysses 2 (padded)": (CFG, Plan({"seq": 8}, sp="usp", ulysses=2)),
    "Megatron-SP+FSDP remat, gap": (
        GAP,
        Plan({"data": 2, "model": 4}, sp="megatron", fsdp=True, remat=True),
    ),
    "Megatron-SP over seq × model, Ulysses inside, remat (padded)": (
        CFG,
        Plan({"data": 2, "seq": 2, "model": 2}, sp="megatron", ulysses=2, remat=True),
    ),
    "Megatron-SP over seq 4 × model 2, USP inside (padded)": (
        CFG,
        Plan({"seq": 4, "model": 2}, sp="megatron", ulysses=2),
    ),
    # remat "dots": the re-run attention g combined with the MLP's backward f (one op).
    "DP×TP remat dots": (CFG, Plan({"data": 4, "model": 2}, remat="dots")),
    "ring+TP+FSDP remat dots": (
        CFG,
        Plan({"data": 2, "seq": 2, "model": 2}, sp="ring", fsdp=True, remat="dots"),
    ),
    # Unrolled layers: no loop between the forward's ring hop and the backward's identical one
    # (r = 2), so XLA merges them in every layer: the same bytes as a one-layer scan's rule.
    "ring+TP+FSDP unrolled (r=2)": (
        CFG,
        Plan({"data": 2, "seq": 2, "model": 2}, sp="ring", fsdp=True, layers="unrolled"),
    ),
    # a ring inside the stages: the uniform form, every phase on every stage
    "PP 1F1B×ring×TP": (
        CFG,
        Plan({"stage": 2, "seq": 2, "model": 2}, sp="ring", pp="1f1b", microbatches=2),
    ),
    # ZBV over 4 stages: down the V and up it, two permutations each way; a tick runs only
    # the one that carries its value (each stated with its device pairs)
    "PP ZBV over 4 stages": (
        dataclasses.replace(CFG, depth=8),
        Plan({"stage": 4, "seq": 2}, sp="ring", pp="zbv", microbatches=4),
    ),
    "Megatron-SP unrolled": (CFG, Plan({"data": 2, "model": 4}, sp="megatron", layers="unrolled")),
    # its regions as collective matmuls: rings of permutes in place of the gathers and scatters
    "Megatron-SP overlap": (CFG, Plan({"data": 2, "model": 4}, sp="megatron", overlap=True)),
    # ... both ways: rings of half blocks along +1 and −1, twice the permutes, the same bytes
    "Megatron-SP overlap both ways": (
        CFG,
        Plan({"data": 2, "model": 4}, sp="megatron", overlap="bidirectional"),
    ),
    # gradient accumulation: the activation collectives once per micro-batch (4 × the ops,
    # the same bytes), the gradient sync once
    "DP×TP×ring 4 micro-batches": (
        CFG,
        Plan({"data": 2, "seq": 2, "model": 2}, sp="ring", microbatches=4),
    ),
    # plain TP's all-reduces per half-batch, as recursive halving's exchanges and an
    # all-gather: scanned (layer 0 before the scan), and on model=4 with per-layer params
    "TP overlap": (CFG, Plan({"model": 2}, overlap=True)),
    "TP overlap per-layer params": (
        CFG,
        Plan({"data": 2, "model": 4}, overlap=True, layers="list"),
    ),
    # FSDP's layers gathered one layer ahead: the same all-gathers, one before the loop; the
    # gradients' reduce-scatters as rings of permutes, one layer behind (TP's on half-batches)
    "FSDP×TP overlap": (CFG, Plan({"data": 4, "model": 2}, fsdp=True, overlap=True)),
    # DP's gradient all-reduce per layer, one layer behind: a ring reduce-scatter (permutes)
    # and an all-gather per bucket and layer, the same bytes as the step-end all-reduce
    "DP×TP overlap": (CFG, Plan({"data": 4, "model": 2}, overlap=True)),
    # ... over data × seq, beside a ring of 2 (the last layer, after the loop, merges its hop)
    "DP×ring×TP overlap": (CFG, Plan({"data": 2, "seq": 2, "model": 2}, sp="ring", overlap=True)),
    "DP overlap bf16 unrolled": (
        CFG,
        Plan({"data": 8}, overlap=True, grad_sync="bfloat16", layers="unrolled"),
    ),
    "Megatron-SP×ring overlap unrolled": (
        CFG,
        Plan({"data": 2, "seq": 2, "model": 2}, sp="megatron", overlap=True, layers="unrolled"),
    ),
    # per-layer params: the unrolled stack's collectives, each layer's from its own buffers
    "FSDP×TP overlap per-layer params": (
        CFG,
        Plan({"data": 4, "model": 2}, fsdp=True, overlap=True, layers="list"),
    ),
    "ZeRO-2 per-layer params": (CFG, Plan({"data": 8}, zero=2, layers="list")),
    # ZeRO-2's per-layer reduce-scatters one layer behind, as recursive halving's exchanges
    "ZeRO-2×TP overlap": (CFG, Plan({"data": 4, "model": 2}, zero=2, overlap=True)),
}
_REPORTS: dict[str, report.Report] = {}


def case_report(name: str) -> report.Report:
    """The contract report of a named case, compiled once per test session."""
    if name not in _REPORTS:
        cfg, plan = {**MATRIX, **COMPOSITIONS}[name]
        _REPORTS[name] = report.inspect(cfg, plan, BATCH)
    return _REPORTS[name]


def assert_contract(rep: report.Report) -> None:
    measured = {key: t.count for key, t in rep.ledger.summary().items()}
    expected = {key: t.count for key, t in rep.expectation.summary().items()}
    assert measured == expected, rep.format()
    assert rep.measured_bytes_sent == pytest.approx(rep.expected_bytes_sent, rel=0.01)
    assert rep.contract_ok, rep.mismatches


# --------------------------------------------------------------------------- the contracts


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_compositions_meet_their_contracts(name):
    assert_contract(case_report(name))


def test_a_pipeline_is_held_to_its_contract_stage_by_stage():
    """Each stage's ledger counts a branch collective by the ticks that stage runs the branch:
    the raw ledger (every branch counted as if it ran every tick) breaks the contract, and
    where stages differ (the last stage pools over seq), the last stage's counts fail stage 0's
    contract."""
    rep = case_report("PP 1F1B×DP×TP")
    assert [stage for stage, _ in rep.others] == [0] and rep.contract_ok, rep.mismatches
    mesh = make_mesh(rep.expectation.plan.mesh)
    raw = Ledger(tuple(parse_hlo(rep.ledger.hlo, mesh)), rep.ledger.hlo)
    raw_report = dataclasses.replace(rep, ledger=raw, others=())
    assert any("all-reduce over model" in m for m in raw_report.mismatches), raw_report.format()
    zb = case_report("PP ZB×Ulysses")
    assert zb.contract_ok, zb.mismatches
    stage0 = dataclasses.replace(zb.others[0][1], ledger=zb.ledger)  # the last stage's counts
    swapped = dataclasses.replace(zb, others=((0, stage0),))
    assert any(m.startswith("stage 0: ") for m in swapped.mismatches), swapped.mismatches


def test_the_anchor_reaches_designs_minimum():
    """DESIGN.md anchor, data=4 × model=2: 18.21 MB per device per step, measured."""
    rep = report.inspect(ANCHOR, Plan({"data": 4, "model": 2}), ANCHOR_BATCH)
    assert_contract(rep)
    assert round(rep.measured_bytes_sent / MB, 2) == 18.21


def test_the_anchor_fsdp_keeps_gathered_weights():
    """DESIGN.md anchor, FSDP over 8 with gathered weights kept: 22.3 MB."""
    rep = report.inspect(ANCHOR, Plan({"data": 8}, fsdp=True), ANCHOR_BATCH)
    assert_contract(rep)
    assert round(rep.measured_bytes_sent / MB, 1) == 22.3


def test_naive_autodiff_sends_more_than_the_minimum(monkeypatch):
    """Without Megatron's f, each of q, k, v all-reduces its own cotangent: 22.47 MB."""
    enter = shardkit.parallel.tensor.enter_tp

    def naive_enter(x, axis, *, token_dim=None):
        # No explicit f: x stays invariant over model; autodiff casts it once per projection.
        return x if token_dim is None else enter(x, axis, token_dim=token_dim)

    monkeypatch.setattr(shardkit.parallel.tensor, "enter_tp", naive_enter)
    rep = report.inspect(ANCHOR, Plan({"data": 4, "model": 2}), ANCHOR_BATCH)
    assert round(rep.measured_bytes_sent / MB, 2) == 22.47
    assert round(rep.expected_bytes_sent / MB, 2) == 18.21
    assert not rep.contract_ok
    assert rep.mismatches == [
        "all-reduce over model: 12,779,520 bytes measured, 8,519,680 expected."
    ]


def test_xlas_automatic_partitioner_does_not_beat_the_minimum():
    """The same model and mesh under jit + NamedSharding, no shard_map (docs/communication.md)."""
    plan = Plan({"data": 4, "model": 2})
    auto = bench.measure_auto(CFG, plan, BATCH)
    minimum = cost.expected(CFG, plan, BATCH).total_bytes_sent()
    assert auto.total_bytes_sent() >= minimum
    assert {axes for _, axes in auto.summary()} <= {("data",), ("model",), ("data", "model")}


# --------------------------------------------------------------------------- it can fail


def closing_step(model: ShardedViT, optimizer):
    """``model.train_step`` with one bug: the body closes over the global, data-split images."""

    def step(params, opt_state, images, labels):
        def local(p, images_local, labels_local):
            # BUG: `images` is the outer, data-sharded array, not this device's block.
            centred = images_local - images.mean()
            return model.loss_and_grads_local(p, centred, labels_local)

        specs = (model.specs, model.batch_spec, model.batch_spec)
        grad_fn = jax.shard_map(
            local, mesh=model.mesh, in_specs=specs, out_specs=(P(), model.specs)
        )
        loss, grads = grad_fn(params, images, labels)
        params, opt_state = apply_optimizer(optimizer, grads, opt_state, params)
        return params, opt_state, {"loss": loss}

    return jax.jit(step, donate_argnums=(0, 1))


def test_closing_over_a_sharded_array_breaks_the_contract():
    plan = Plan({"data": 4, "model": 2})
    model, optimizer = ShardedViT(CFG, plan), report.default_optimizer()
    args = report.step_args(model, BATCH, optimizer)
    ledger = measure(closing_step(model, optimizer), *args, mesh=model.mesh)
    rep = report.Report(ledger, cost.expected(CFG, plan, BATCH))
    assert not rep.contract_ok
    assert rep.mismatches[0] == "all-gather over data: 1 ops measured, 0 expected."


def test_an_extra_psum_breaks_the_contract(monkeypatch):
    pool = shardkit.models.vit.model._pool_local

    def pool_twice(x, cfg, lay):
        # BUG: a psum of an already-summed (invariant) value: n·x / n, one all-reduce each way.
        return jax.lax.pmean(pool(x, cfg, lay), "model")

    monkeypatch.setattr(shardkit.models.vit.model, "_pool_local", pool_twice)
    rep = report.model_report(ShardedViT(CFG, Plan({"data": 4, "model": 2})), BATCH)
    assert rep.mismatches == ["all-reduce over model: 10 ops measured, 8 expected."]


# --------------------------------------------------------------------------- report and plot


def test_report_json_table_and_hlo(tmp_path):
    # "mu": ONE layer (no layer loop, so XLA merges the ring's forward and backward K/V hop,
    # as the cost model states for l = 1, r = 2) and 17 tokens padded to 18.
    hlo = tmp_path / "step.hlo"
    cfg = vit_ref.variant("mu")
    rep = report.inspect(cfg, Plan({"data": 4, "seq": 2}, sp="ring"), 8, hlo_path=hlo)
    assert hlo.read_text() == rep.ledger.hlo and "collective-permute" in rep.ledger.hlo
    data = json.loads(json.dumps(rep.to_json()))
    assert {"collectives", "measured_bytes_sent", "expected_bytes_sent", "memory"} <= set(data)
    assert set(data["memory"]) == {"argument", "output", "temp"}
    row_keys = {"kind", "axes", "count", "bytes_sent", "expected_count", "expected_bytes_sent"}
    assert all(row_keys <= set(row) and row["ok"] for row in data["collectives"])
    assert data["contract_ok"] and data["measured_bytes_sent"] == data["expected_bytes_sent"]
    assert data["memory"]["argument"] > 0
    text = rep.format()
    assert "contract: ✓ holds" in text and "measured / expected bytes: 1.0000" in text


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    from shardkit.comm.plot import plot_report, traffic_matrix

    rep = case_report("2×2×2 ring+TP+FSDP")
    path = plot_report(rep, tmp_path / "pattern.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    # The device matrix holds every byte the ledger counts (ring model per group).
    assert traffic_matrix(rep).sum() == pytest.approx(8 * rep.measured_bytes_sent)


del jnp
