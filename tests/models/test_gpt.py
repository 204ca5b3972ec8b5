"""The GPT's train step (``shardkit.models.gpt``) held to its contract (``models.gpt.cost``,
written from the formulas).

The decoder (Llama style: causal zigzag ring over seq, GQA, TP over model, the vocabulary
split over model, DP over data; MoE blocks with experts over expert) compiled on a few meshes:
every op count exact and bytes within 1%, no implicit collectives; the logits [B, T, V] never
travel (the loss reduces [B, T] floats). The ring's K/V blocks carry h_kv/n_model heads (one
under ``kv_repeat``), so with GQA the ring moves h_kv/h of what multi-head attention moves,
in the ledger of the whole step, not only of the attention alone.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest

import shardkit
from shardkit import testing
from shardkit.comm import contract
from shardkit.models import gpt
from shardkit.parallel import lm, moe
from shardkit.parallel.sequence import layouts
from shardkit.run import lm as run_lm

BATCH = 8


def local_param_count(model, params):
    """Elements of the params one device holds (its fragments)."""
    placed = model.shard(params)
    return sum(leaf.addressable_shards[0].data.size for leaf in jax.tree.leaves(placed))


def measured_step(shape, kv_heads, experts=None, fsdp=False):
    """The ledger of the GPT's clipped train step on ``shape`` (zigzag over seq; ``fsdp``:
    params split over data), held to ``models.gpt.cost.expected``."""
    base = gpt.GPTConfig() if experts is None else gpt.moe_config(experts)
    cfg = dataclasses.replace(base, kv_heads=kv_heads)
    plan = gpt.GPTPlan(shape, "zigzag" if shape.get("seq", 1) > 1 else "contiguous", fsdp=fsdp)
    gpt.check_plan(cfg, plan, BATCH)
    model = gpt.sharded_gpt(shardkit.make_mesh(shape), cfg, plan)
    params = gpt.init(0, cfg)
    optimizer = optax.adamw(1e-3)
    step = model.train_step(optimizer, clip_norm=1.0)
    p = model.shard(params)
    state = model.init_opt_state(optimizer, p)
    x, y = gpt.windows(np.random.default_rng(0), BATCH, cfg.tokens)
    n_seq = plan.mesh["seq"]
    batch = model.shard_batch(*(layouts.to_layout(a, n_seq, plan.layout) for a in (x, y)))
    want = gpt.expected(cfg, plan, BATCH, local_param_count(model, params))
    return contract.assert_contract(step, p, state, *batch, expected=want)


MESHES = [  # the last: model outnumbers the KV heads (kv_repeat)
    {"data": 2, "seq": 2, "model": 2},
    {"seq": 4, "model": 2},
    {"data": 2, "seq": 4},
    {"seq": 2, "model": 4},
]


@pytest.mark.parametrize("shape", MESHES)
def test_gpt_step_meets_its_contract(shape):
    measured_step(shape, kv_heads=2)


@pytest.mark.parametrize(
    ("shape", "experts"),
    [({"data": 4, "model": 2}, None), ({"data": 2, "expert": 4}, moe.MoE(8, 2, 1.25)),
     ({"data": 2, "expert": 2, "seq": 2}, moe.MoE(8, 2, 1.25))],
)  # fmt: skip
def test_fsdp_step_meets_its_contract(shape, experts):
    """FSDP: one all-gather and one reduce-scatter over data per bucket (two with TP), the
    rest of the gradient sync over expert × seq only (the experts': seq), the loss alone or
    with the norm: exact, dense and MoE (the EP × FSDP plan of ``shardkit verify``)."""
    measured_step(shape, kv_heads=2, experts=experts, fsdp=True)


def test_gqa_ring_moves_h_kv_over_h_of_mha_in_the_whole_step():
    """Same mesh and model, 8 query heads: 1 KV head (MQA) vs 8 (MHA), ring bytes 1 : 8."""
    shape = {"seq": 4}
    key = ("collective-permute", ("seq",))
    mqa = measured_step(shape, kv_heads=1).summary()[key]
    mha = measured_step(shape, kv_heads=8).summary()[key]
    assert mqa.count == mha.count
    assert mqa.bytes_sent * 8 == mha.bytes_sent


MOE_MESHES = [
    {"data": 2, "expert": 4},
    {"data": 2, "expert": 2, "model": 2},
    {"expert": 2, "seq": 4},
]


@pytest.mark.parametrize("shape", MOE_MESHES)
def test_moe_gpt_step_meets_its_contract(shape):
    """The MoE GPT (E = 8, top-2, capacity 1.25) under EP × DP, EP × TP × DP, EP × ring: the
    all-to-alls, counts and expert-gradient sync exact, beside every dense term."""
    measured_step(shape, kv_heads=2, experts=moe.MoE(8, 2, 1.25))


def test_moe_gpt_twin_equals_sharded_with_drops():
    """Capacity 0.5 drops a third of the assignments: the twin, routing the sharded run's
    groups in their zigzag order, still agrees on every leaf (≤ 1e-5)."""
    cfg = gpt.moe_config(moe.MoE(8, 2, 0.5))
    plan = gpt.GPTPlan({"expert": 2, "seq": 4}, "zigzag")
    model = gpt.sharded_gpt(shardkit.make_mesh(plan.mesh), cfg, plan)
    params, (x, y) = gpt.init(0, cfg), gpt.windows(np.random.default_rng(0), BATCH, cfg.tokens)
    order = lambda a: layouts.to_layout(a, 4, "zigzag")  # noqa: E731

    def sharded(p, x, y):
        out, grads = model.loss_and_grads(p, order(x), order(y))
        assert float(out["dropped_fraction"]) > 0.1  # the case drops tokens
        return out["loss"], grads

    twin = lambda p, x, y: gpt.twin_loss(p, x, y, cfg, plan)  # noqa: E731
    testing.compare_sharded(sharded, twin, params, x, y, place=model.shard).assert_ok()


def test_document_windows_mark_their_lines():
    """Packed documents: segment ids count the lines from 0, positions restart at every line,
    and a target in the next line is ``lm.IGNORE`` (the line's last token predicts nothing)."""
    x, y, seg, pos = (np.asarray(a) for a in gpt.windows(np.random.default_rng(0), 8, 64, True))
    newline = gpt.CHARS.index("\n")
    assert (seg[:, 0] == 0).all() and (np.diff(seg, axis=1) == (x[:, :-1] == newline)).all()
    starts = np.concatenate([np.ones((8, 1), bool), np.diff(seg, axis=1) > 0], axis=1)
    assert (pos[starts] == 0).all() and (np.diff(pos, axis=1)[~starts[:, 1:]] == 1).all()
    assert ((y == lm.IGNORE) == (x == newline)).all()


def test_the_document_mask_changes_the_loss():
    """The mask is real: the twin with segments and without them differ on the same batch."""
    cfg = gpt.GPTConfig(documents=True)
    params = gpt.init(0, cfg)
    x, y, seg, _ = gpt.windows(np.random.default_rng(0), 8, cfg.tokens, True)
    masked = gpt.twin_loss(params, x, y, cfg, seg=seg)
    assert abs(float(masked) - float(gpt.twin_loss(params, x, y, cfg))) > 1e-3


def test_the_pallas_kernel_matches_the_twin():
    """Packed documents (segment ids into the kernel) on a zigzag ring × TP, attention on
    splash (Pallas' interpreter here): equal to the twin, and a Pallas kernel does run."""
    cfg = gpt.GPTConfig(documents=True)
    plan = run_lm.plan("seq=2,model=2", "ring", False, kernel="pallas")
    case = run_lm.verify_case(cfg, "pallas", plan, BATCH)
    assert case["ok"], case
    model, params = run_lm.build(cfg, plan, BATCH), gpt.init(0, cfg)
    data = run_lm.ordered(plan, *run_lm.sample(cfg, BATCH))
    assert "pallas_call" in str(jax.make_jaxpr(model.loss_and_grads)(model.shard(params), *data))


PIPELINES = [  # (mesh, plan options): each schedule once, with DP, TP, Ulysses and FSDP
    ({"stage": 2}, dict(pp="1f1b", microbatches=4)),
    ({"data": 2, "stage": 2, "model": 2}, dict(pp="zb", microbatches=2)),
    ({"stage": 2, "seq": 2, "model": 2},
     dict(pp="interleaved", microbatches=2, virtual=2, core="ulysses", layout="striped")),
    ({"data": 2, "stage": 2}, dict(pp="gpipe", microbatches=2, fsdp=True)),
    # a causal zigzag ring inside the stages: the engine's uniform form
    ({"stage": 2, "seq": 2, "model": 2},
     dict(pp="interleaved", microbatches=2, virtual=2, layout="zigzag")),
    ({"data": 2, "stage": 2, "model": 2}, dict(pp="zbv", microbatches=2, fsdp=True)),
]  # fmt: skip


@pytest.mark.parametrize(("shape", "options"), PIPELINES)
def test_a_pipelined_gpt_equals_its_twin(shape, options):
    """Embedding on the first stage, norm, head and loss on the last: loss, every gradient
    leaf and one AdamW step equal the unsharded twin's."""
    cfg = gpt.GPTConfig(layers=4)
    case = run_lm.verify_case(cfg, "pipeline", gpt.GPTPlan(shape, **options), BATCH)
    assert case["ok"] and case["pp"].startswith(f"{options['pp']} M="), case


def test_a_pipelined_gpt_meets_its_contract_stage_by_stage():
    """1F1B × DP × TP: each stage's ledger (every branch counted by its ticks) against that
    stage's terms: the permutes, the embedding's g on stage 0, the head's f and the
    cross-entropy's reductions on the last stage, the ends' all-reduce over stage."""
    plan = gpt.GPTPlan({"data": 2, "stage": 2, "model": 2}, pp="1f1b", microbatches=2)
    report = json.loads(run_lm.inspect(gpt.GPTConfig(), plan, 16, as_json=True))
    assert report["contract_ok"] and report["ratio"] == pytest.approx(1.0), report["mismatches"]
    assert len(report["stage_flops"]) == 2


MOE_PIPELINES = [  # the MoE decoder pipelined: all-to-alls over expert inside the stages
    gpt.GPTPlan({"data": 2, "stage": 2, "expert": 2}, pp="zb", microbatches=2),
    # a ppermute too (the causal ring): the uniform form, every all-to-all on every stage
    gpt.GPTPlan({"stage": 2, "expert": 2, "seq": 2}, "zigzag", pp="interleaved",
                microbatches=2, virtual=2),
]  # fmt: skip


@pytest.mark.parametrize("plan", MOE_PIPELINES, ids=["ZB-H1 × EP × DP", "interleaved × EP × ring"])
def test_a_pipelined_moe_gpt_equals_its_twin(plan):
    """Each chunk returns its microbatch's load-balance and z-losses (over M) as the engine's
    aux loss: loss, every gradient leaf (router included) and one AdamW step equal the twin
    that routes and balances each microbatch apart, at capacity factor 1.0; and the contract
    holds stage by stage (the all-to-alls and counts per F and B phase run, at a microbatch's
    capacity)."""
    cfg = gpt.moe_config(moe.MoE(8, 2, 1.0), layers=4)
    case = run_lm.verify_case(cfg, "moe", plan, BATCH)
    assert case["ok"], case
    report = json.loads(run_lm.inspect(cfg, plan, BATCH, as_json=True))
    assert report["contract_ok"] and report["ratio"] == pytest.approx(1.0), report["mismatches"]


@pytest.mark.parametrize("plan", MOE_PIPELINES, ids=["ZB-H1 × EP × DP", "interleaved × EP × ring"])
def test_pipelined_routing_metrics_sum_the_microbatches(plan):
    """Under a pipeline each chunk's routing counts are summed by the engine over its forwards:
    tokens per expert and dropped assignments are exactly the sums of the unpipelined decoder's
    on each microbatch alone (the same routing groups: each device's rows m·b/M ...), and the
    dropped fraction is over the step's routed assignments."""
    cfg = gpt.moe_config(moe.MoE(8, 2, 1.0), layers=4)
    params, (x, y) = gpt.init(0, cfg), run_lm.ordered(plan, *run_lm.sample(cfg, BATCH))
    piped = run_lm.build(cfg, plan, BATCH)
    got, _ = piped.loss_and_grads(piped.shard(params), *piped.shard_batch(x, y))
    mesh = {k: n for k, n in plan.mesh.items() if k != "stage"}
    flat_plan = dataclasses.replace(plan, mesh=mesh, pp="none", microbatches=1, virtual=1)
    micro = BATCH // plan.microbatches
    flat = run_lm.build(cfg, flat_plan, micro)
    rows = plan.mesh.get("data", 1) * plan.mesh.get("expert", 1)  # devices along the batch
    parts = [a.reshape(rows, plan.microbatches, -1, a.shape[-1]) for a in (x, y)]
    want = [
        flat.loss_and_grads(flat.shard(params), *flat.shard_batch(
            *(p[:, m].reshape(micro, -1) for p in parts)))[0]
        for m in range(plan.microbatches)
    ]  # fmt: skip
    per_expert = sum(np.asarray(w["tokens_per_expert"]) for w in want)
    dropped = sum(float(w["dropped"]) for w in want)
    np.testing.assert_array_equal(np.asarray(got["tokens_per_expert"]), per_expert)
    assert float(got["dropped"]) == dropped
    assert per_expert.sum() == BATCH * cfg.tokens * 2 * cfg.layers  # every assignment, top-2
    assert float(got["dropped_fraction"]) == pytest.approx(dropped / per_expert.sum())


def test_the_tied_twin_is_the_untied_one_with_the_embeddings_transpose():
    tied = gpt.GPTConfig(tied=True)
    p = gpt.init(0, tied)
    assert "head" not in p and set(p) == set(gpt.param_axes(tied=True))
    x, y = gpt.windows(np.random.default_rng(0), 2, tied.tokens)
    untied = gpt.twin_loss({**p, "head": p["embed"].T}, x, y, gpt.GPTConfig())
    np.testing.assert_allclose(gpt.twin_loss(p, x, y, tied), untied, rtol=1e-6)


TIED = [  # tied embeddings: TP × ring; pipelined, the head's gradient meets the lookup's
    gpt.GPTPlan({"data": 2, "seq": 2, "model": 2}, "zigzag"),
    gpt.GPTPlan({"data": 2, "stage": 2, "model": 2}, pp="1f1b", microbatches=2),
]


@pytest.mark.parametrize("plan", TIED, ids=["TP × ring", "1F1B × DP × TP"])
def test_a_tied_gpt_equals_its_twin_and_meets_its_contract(plan):
    """The head is the embedding's transpose: loss, gradients and one AdamW step equal the
    twin's, and the contract is exact: under a pipeline the embedding's gradient (its lookup's
    on stage 0 plus the head's on the last) rides the ends' one all-reduce over stage, once."""
    cfg = gpt.GPTConfig(tied=True)
    case = run_lm.verify_case(cfg, "tied", plan, BATCH)
    assert case["ok"], case
    report = json.loads(run_lm.inspect(cfg, plan, BATCH, as_json=True))
    assert report["contract_ok"] and report["ratio"] == pytest.approx(1.0), report["mismatches"]
    assert report["tied"]


def test_pipelined_packed_documents_equal_the_twin_and_the_contract():
    """1F1B × DP × TP: each microbatch's segment ids and positions reach every chunk on every
    stage (RoPE restarts per document), the loss divides by the global count of real
    targets: equal to the twin, and the contract exact (the count's one all-reduce added).
    With a ring inside the stages: ``test_lm_cli``'s ZBV case."""
    cfg = gpt.GPTConfig(documents=True)
    plan = gpt.GPTPlan({"data": 2, "stage": 2, "model": 2}, pp="1f1b", microbatches=2)
    case = run_lm.verify_case(cfg, "documents", plan, BATCH)
    assert case["ok"], case
    report = json.loads(run_lm.inspect(cfg, plan, BATCH, as_json=True))
    assert report["contract_ok"] and report["ratio"] == pytest.approx(1.0), report["mismatches"]


@pytest.mark.parametrize(
    "plan",
    [
        # a zigzag causal ring inside the stages (uniform form): terms that count the F and B
        # phases every device runs (``pipeline.chunk_runs``)
        gpt.GPTPlan(
            {"stage": 2, "seq": 2, "model": 2},
            "zigzag",
            pp="interleaved",
            microbatches=2,
            virtual=2,
        ),
        # ZBV: the embedding and the head (its f, the cross-entropy's reductions) both on
        # stage 0, the turn on stage 1 without a send
        gpt.GPTPlan({"data": 2, "stage": 2, "model": 2}, pp="zbv", microbatches=2, fsdp=True),
    ],
    ids=["zigzag ring × interleaved", "ZBV × TP × FSDP"],
)
def test_more_pipelines_meet_their_contracts(plan):
    report = json.loads(run_lm.inspect(gpt.GPTConfig(layers=4), plan, BATCH, as_json=True))
    assert report["contract_ok"] and report["ratio"] == pytest.approx(1.0), report["mismatches"]
