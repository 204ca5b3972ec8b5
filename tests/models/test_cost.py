"""Tests for shardkit.cost: the analytic cost model on paper (nothing here compiles).

The compiled programs are held to these numbers in tests/models/test_contracts.py; here the formulas
are checked against hand computation, against each other (identities that must hold whatever
the plan) and against DESIGN.md's anchor figures.
"""

import dataclasses

import jax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import vit_ref
from shardkit.comm import bytes as ring
from shardkit.comm import contract, terms
from shardkit.comm.ledger import Tally
from shardkit.mesh import Plan, PlanError
from shardkit.models.vit import cost

CFG = vit_ref.ViTConfig(
    image=32, patch=4, classes=10, dim=64, depth=2, heads=8, mlp_dim=128, pool="tok"
)
GAP = dataclasses.replace(CFG, pool="gap")
ANCHOR = vit_ref.ViTConfig(
    image=32, patch=4, classes=10, dim=256, depth=4, heads=4, mlp_dim=1024, pool="tok"
)
W = 4  # float32 bytes


def params(cfg):
    shapes = jax.eval_shape(lambda: vit_ref.init(jax.random.key(0), cfg))
    return sum(x.size for x in jax.tree.leaves(shapes))


def bytes_of(e, kind=None, axes=None, phase=None):
    return sum(
        t.bytes_sent
        for t in e.terms
        if (kind is None or t.kind == kind)
        and (axes is None or t.axes == axes)
        and (phase is None or t.phase == phase)
    )


def counts(e):
    return {key: t.count for key, t in e.summary().items()}


# --------------------------------------------------------------------------- ring model


def test_ring_model_table():
    assert ring.all_reduce_bytes(64, 4) == 96
    assert ring.all_gather_bytes(64, 4) == 48
    assert ring.reduce_scatter_bytes(64, 4) == 48
    assert ring.all_to_all_bytes(64, 4) == 48
    assert ring.permute_bytes(64) == 64
    assert ring.all_reduce_bytes(64, 1) == 0


# --------------------------------------------------------------------------- data


def test_dp_is_one_all_reduce_of_every_gradient_plus_the_loss():
    e = cost.expected(CFG, Plan({"data": 8}), 16)
    assert counts(e) == {("all-reduce", ("data",)): 1}
    assert e.total_bytes_sent() == ring.all_reduce_bytes((params(CFG) + 1) * W, 8)


def test_step_end_all_reduces_over_the_same_devices_fuse_into_one_op():
    e = cost.expected(CFG, Plan({"data": 4, "model": 2}), 16)
    data_terms = [t for t in e.terms if t.axes == ("data",)]
    assert len(data_terms) == 3  # model-split bucket, model-replicated bucket, loss
    assert all(t.fused == cost.STEP_END for t in data_terms)
    assert e.summary()[("all-reduce", ("data",))].count == 1


def test_fsdp_moves_dp_bytes_as_gather_and_scatter():
    dp = cost.expected(CFG, Plan({"data": 8}), 16)
    fsdp = cost.expected(CFG, Plan({"data": 8}, fsdp=True), 16)
    assert fsdp.total_bytes_sent() == pytest.approx(dp.total_bytes_sent())
    assert bytes_of(fsdp, "all-gather") == bytes_of(fsdp, "reduce-scatter")
    # One gather and one scatter per bucket: each layer's 12 leaves (l = 2) and the 7 outer
    # leaves each travel as one flat buffer.
    assert counts(fsdp)[("all-gather", ("data",))] == 2 + 1
    assert counts(fsdp)[("reduce-scatter", ("data",))] == 2 + 1


PLANS = [
    Plan({"data": 8}),
    Plan({"data": 4, "model": 2}),
    Plan({"data": 2, "model": 4}, sp="megatron"),
    Plan({"data": 2, "seq": 4}, sp="ring"),
    Plan({"data": 2, "seq": 4}, sp="ulysses"),
    Plan({"data": 2, "seq": 4}, sp="usp", ulysses=2),
    Plan({"data": 2, "seq": 2, "model": 2}, sp="ring"),
    Plan({"data": 2, "seq": 2, "model": 2}, sp="ulysses"),
    Plan({"data": 2, "seq": 2, "model": 2}, sp="megatron"),
]


@given(st.sampled_from(PLANS), st.sampled_from([CFG, GAP]))
def test_fsdp_without_remat_sends_the_same_bytes(plan, cfg):
    """RS_data + AG_data + AR_tokens(P/n_data) = AR_(data,tokens)(P): 2P(n−1)/n either way.
    With tokens split the token-indexed rows (cls, pos_embedding) stay whole under FSDP
    (``vit.param_axes``): their own-rows gather is the same as without FSDP."""
    fsdp = cost.expected(cfg, dataclasses.replace(plan, fsdp=True), 16)
    plain = cost.expected(cfg, plan, 16)
    assert fsdp.total_bytes_sent() == pytest.approx(plain.total_bytes_sent())


def test_zero1_sends_one_all_reduce_worth():
    terms = contract.zero1_terms(split_elements=1000, replicated_elements=10, n=4)
    assert [t.kind for t in terms] == ["reduce-scatter", "all-gather", "all-reduce"]
    total = sum(t.bytes_sent for t in terms)
    assert total == ring.all_reduce_bytes(1000 * W, 4) + ring.all_reduce_bytes(10 * W, 4)
    assert contract.zero1_terms(1000, 0, n=1) == []


# --------------------------------------------------------------------------- tensor / sequence


def test_tp_is_four_all_reduces_per_block():
    e = cost.expected(CFG, Plan({"model": 8}), 16)
    activation = 16 * CFG.num_tokens * CFG.dim * W
    assert counts(e) == {("all-reduce", ("model",)): 4 * CFG.depth}
    assert e.total_bytes_sent() == 4 * CFG.depth * ring.all_reduce_bytes(activation, 8)


def test_remat_re_runs_attentions_g_only():
    e = cost.expected(CFG, Plan({"model": 8}, remat=True), 16)
    assert counts(e)[("all-reduce", ("model",))] == 5 * CFG.depth


def test_megatron_sp_moves_tps_activation_bytes_when_tokens_divide():
    # 64 tokens (gap) split over model=4: AG + RS pairs carry exactly the all-reduces' bytes.
    msp = cost.expected(GAP, Plan({"model": 4}, sp="megatron"), 16)
    tp = cost.expected(GAP, Plan({"model": 4}), 16)
    assert bytes_of(msp, axes=("model",), phase="forward") - bytes_of(
        msp, "all-reduce", phase="forward"
    ) == pytest.approx(bytes_of(tp, phase="forward"))
    # 4 per block, + 1: the pos_embedding gradient rows gathered over the tokens' axis.
    assert counts(msp)[("all-gather", ("model",))] == 4 * GAP.depth + 1


@pytest.mark.parametrize("inner", ["ring", "ulysses"])
def test_megatron_sp_over_seq_gathers_only_its_seq_block(inner):
    """Tokens over seq=2 × model=2: each TP region gathers T'/2 tokens over model (half the
    bytes of Megatron-SP over model alone) and attention moves exactly what ``--sp inner``
    moves on the same mesh, where the residual stream holds twice as many tokens."""
    ulysses = 2 if inner == "ulysses" else None
    msp = cost.expected(GAP, Plan({"seq": 2, "model": 2}, sp="megatron", ulysses=ulysses), 16)
    alone = cost.expected(GAP, Plan({"model": 2}, sp="megatron"), 16)
    plain = cost.expected(GAP, Plan({"seq": 2, "model": 2}, sp=inner), 16)
    kind = {"ring": "collective-permute", "ulysses": "all-to-all"}[inner]
    assert msp.summary()[(kind, ("seq",))] == plain.summary()[(kind, ("seq",))]
    for tp in ("all-gather", "reduce-scatter"):
        for phase in ("forward", "backward"):
            assert bytes_of(msp, tp, phase=phase) == pytest.approx(
                bytes_of(alone, tp, phase=phase) / 2
            )
    assert cost.geometry(GAP, msp.plan, 16).token_axes == ("seq", "model")


def test_tokens_are_padded_to_the_shard_count_and_masked_without_communication():
    g = cost.geometry(CFG, Plan({"data": 2, "seq": 4}, sp="ring"), 16)
    assert (g.cfg.num_tokens, g.padded_tokens, g.t, g.padded) == (65, 68, 17, True)
    ring = cost.expected(CFG, Plan({"data": 2, "seq": 4}, sp="ring"), 16)
    # The padding mask is computed from positions on every device: no mask term, and the
    # permutes are exactly the K/V (forward 2·l·(r−1), backward 2·l·(r−1)) + dK/dV (2·l·r) hops.
    assert not [t for t in ring.terms if "mask" in t.what]
    assert counts(ring)[("collective-permute", ("seq",))] == 2 * 2 * 3 * 2 + 2 * 2 * 4


def test_ring_hops():
    e = cost.expected(GAP, Plan({"data": 2, "seq": 4}, sp="ring"), 16)
    block = 8 * 16 * CFG.heads * CFG.head_dim * W  # b·t·h·k: 8 images, 64/4 tokens
    permutes = e.summary()[("collective-permute", ("seq",))]
    # forward 2·l·(r−1) K/V; backward 2·l·(r−1) K/V + 2·l·r dK/dV.
    assert permutes == Tally(2 * 2 * 3 * 2 + 2 * 2 * 4, (2 * 2 * 3 * 2 + 2 * 2 * 4) * block)


def test_ulysses_is_four_all_to_alls_each_way():
    e = cost.expected(CFG, Plan({"data": 2, "seq": 4}, sp="ulysses"), 16)
    assert counts(e)[("all-to-all", ("seq",))] == 8 * CFG.depth
    # The padding mask of the 68 tokens is built locally: the one all-gather over seq is the
    # cls and pos_embedding gradient rows at the step's end, (n−1)/n · 68 · d · w.
    gathers = [t for t in e.terms if t.kind == "all-gather"]
    assert [(t.axes, t.phase, t.bytes_sent) for t in gathers] == [
        (("seq",), cost.STEP_END, ring.all_gather_bytes(68 * CFG.dim * W, 4))
    ]


def test_usp_splits_the_seq_axis_and_degenerates_to_the_pure_modes():
    usp = cost.expected(CFG, Plan({"data": 2, "seq": 4}, sp="usp", ulysses=2), 16)
    assert {axes for _, axes in usp.summary()} >= {("seq_ring",), ("seq_ulysses",)}
    ring = cost.expected(CFG, Plan({"seq": 8}, sp="usp", ulysses=1), 16)
    assert cost.geometry(CFG, Plan({"seq": 8}, sp="usp", ulysses=1), 16).attention == "ring"
    assert ("collective-permute", ("seq",)) in ring.summary()
    uly = cost.geometry(CFG, Plan({"seq": 8}, sp="usp", ulysses=8), 16)
    assert (uly.attention, uly.ulysses_axis) == ("ulysses", "seq")


def test_pooling_over_token_shards_is_one_all_reduce():
    e = cost.expected(GAP, Plan({"seq": 8}, sp="ring"), 16)
    pool = [t for t in e.terms if t.what.startswith("pooled")]
    assert [(t.count, t.bytes_sent) for t in pool] == [
        (1, ring.all_reduce_bytes(16 * GAP.dim * W, 8))
    ]


# --------------------------------------------------------------------------- anchors


def test_design_anchor_figures():
    """DESIGN.md: 4-layer ViT, dim 256, batch 32, 8 devices (MB = 10^6 bytes)."""
    dp_tp = cost.expected(ANCHOR, Plan({"data": 4, "model": 2}), 32)
    assert round(dp_tp.total_bytes_sent() / 1e6, 2) == 18.21
    fsdp = cost.expected(ANCHOR, Plan({"data": 8}, fsdp=True), 32)
    assert round(fsdp.total_bytes_sent() / 1e6, 1) == 22.3
    # Re-gathered: DESIGN's 33.5 MB is 3(n−1)/n·P·w; only block weights are re-gathered, and
    # not the last bias: 33.37 MB.
    remat = cost.expected(ANCHOR, Plan({"data": 8}, fsdp=True, remat=True), 32)
    three = 3 * 7 / 8 * params(ANCHOR) * W
    assert remat.total_bytes_sent() == pytest.approx(three, rel=0.005)
    assert round(remat.total_bytes_sent() / 1e6, 2) == 33.37


# --------------------------------------------------------------------------- contract check


def test_compare_lists_each_broken_clause():
    want = {("all-reduce", ("data",)): Tally(1, 100.0)}
    assert terms.compare(want, {("all-reduce", ("data",)): Tally(1, 100.5)}) == []
    problems = terms.compare(
        want, {("all-reduce", ("data",)): Tally(2, 102.0), ("all-gather", ("data",)): Tally(1, 8)}
    )
    assert problems == [
        "all-gather over data: 1 ops measured, 0 expected.",
        "all-gather over data: 8 bytes measured, 0 expected.",
        "all-reduce over data: 2 ops measured, 1 expected.",
        "all-reduce over data: 102 bytes measured, 100 expected.",
    ]


def test_remat_on_one_layer_is_an_upper_bound():
    one = dataclasses.replace(CFG, depth=1)
    assert cost.expected(one, Plan({"model": 8}), 16).exact
    assert cost.expected(CFG, Plan({"model": 8}, remat=True), 16).exact
    assert not cost.expected(one, Plan({"model": 8}, remat=True), 16).exact
    want = {("all-reduce", ("model",)): Tally(5, 500.0)}
    merged = {("all-reduce", ("model",)): Tally(4, 400.0)}
    assert terms.compare(want, merged, exact=False) == []
    assert terms.compare(want, merged) != []
    more = {("all-reduce", ("model",)): Tally(6, 600.0), ("all-gather", ("data",)): Tally(1, 8)}
    assert len(terms.compare(want, more, exact=False)) == 4


def test_one_layer_ring_of_two_merges_the_backward_hop():
    # No layer loop and a one-trip hop loop: the backward's K/V hop IS the forward's.
    one = dataclasses.replace(GAP, depth=1)
    e = cost.expected(one, Plan({"data": 4, "seq": 2}, sp="ring"), 16)
    assert counts(e)[("collective-permute", ("seq",))] == 2 + 2 * 2  # K, V + dK, dV home


def test_an_impossible_plan_fails_before_any_formula():
    with pytest.raises(PlanError, match="heads=8 is not divisible by model=3"):
        cost.expected(CFG, Plan({"model": 3}), 16)
    with pytest.raises(PlanError, match="batch=10"):
        cost.expected(CFG, Plan({"data": 4}), 10)


def test_format_lists_every_term():
    e = cost.expected(CFG, Plan({"data": 2, "seq": 2, "model": 2}, sp="ring", fsdp=True), 16)
    text = e.format()
    assert len(text.splitlines()) == len(e.terms) + 2
    assert "Megatron f" in text and "dK, dV" in text
