"""``shardkit plan --target``: the plans enumerated, estimated on paper, compiled for a TPU
slice by the TPU compiler on this CPU machine (libtpu, no chip), cached, and ranked.

A small ViT keeps each TPU compile to seconds; ``conftest`` keeps this process's own backend on
the CPU (``JAX_PLATFORMS=cpu``).
"""

from __future__ import annotations

import json
import math

import pytest

import vit_ref
from shardkit import cli
from shardkit.mesh import Plan, PlanError
from shardkit.models.vit import cost
from shardkit.run import planner, target
from shardkit.run.bench import model_flops

SMALL = ["--variant", "mu", "--depth", "2", "--heads", "2", "--batch", "16"]
CFG = vit_ref.variant("mu", depth=2, heads=2)
V5E = planner.CHIPS["TPU v5 lite"]


def test_candidates_cover_the_families_and_every_one_runs_the_model():
    plans = planner.candidates(CFG, 8, 16, Plan())
    assert all(p.num_devices == 8 for p in plans)
    names = {planner.label(p) for p in plans}
    for expected in ["data=8", "data=8 zero1", "data=8 fsdp", "data=4,model=2",
                     "data=4,model=2 megatron", "data=2,seq=4 ring", "data=4,seq=2 ulysses",
                     "data=4,stage=2 1f1b×4"]:  # fmt: skip
        assert expected in names, expected
    assert not any(p.mesh["model"] == 4 for p in plans)  # 2 heads do not split over 4
    assert len(names) == len(plans)


def test_the_paper_estimate_is_the_contract_and_the_paper_flops():
    """Bytes: the contract's (the busiest stage's under a pipeline); compute: the paper FLOPs
    over the chips at the chip's step throughput, stretched by the pipeline's bubble."""
    dp = Plan({"data": 8})
    e = planner.analytic(CFG, dp, 16, V5E)
    assert e.bytes_sent == cost.expected(CFG, dp, 16, platform="tpu").total_bytes_sent()
    flops = model_flops(CFG, 16) / 8
    assert e.compute_s == pytest.approx(flops / V5E.step_flops(flops))
    assert e.comm_s == pytest.approx(e.bytes_sent / (2 * V5E.link_bytes))
    pp = Plan({"data": 4, "stage": 2}, pp="1f1b", microbatches=4)
    piped = planner.analytic(CFG, pp, 16, V5E)
    assert piped.bubble == pytest.approx(1 / 5)  # (S − 1) / (M + S − 1)
    assert piped.compute_s == pytest.approx(e.compute_s / (1 - 1 / 5))


def test_bf16_gradient_sync_halves_the_paper_estimate_of_the_gradient_bucket():
    """``plan --grad-sync bfloat16`` hands every candidate ``grad_sync``: on paper DP's
    gradient bucket costs half (the loss stays float32), and the label says so."""
    plans = planner.candidates(CFG, 8, 16, Plan(grad_sync="bfloat16"))
    assert plans and all(p.grad_sync == "bfloat16" for p in plans)
    f32, bf16 = (planner.analytic(CFG, Plan({"data": 8}, grad_sync=g), 16, V5E)
                 for g in ("float32", "bfloat16"))  # fmt: skip
    assert bf16.bytes_sent == pytest.approx(f32.bytes_sent / 2, rel=1e-3)
    assert planner.label(bf16.plan) == "data=8 grads=bfloat16"


def test_plans_whose_state_overflows_the_chip_are_dropped_before_compiling(capsys):
    """A 1.6-billion-parameter ViT: its float32 params and AdamW moments (19 GB) overflow a
    v5e's 16 GiB unless split; those plans are counted as dropped and never compiled."""
    big = ["--dim", "4096", "--depth", "8", "--heads", "32", "--mlp-dim", "16384", "--image",
           "64", "--patch", "16", "--batch", "64", "--dtype", "bfloat16"]  # fmt: skip
    assert cli.main(["plan", "--target", "v5e:2x4", "--keep", "0", "--json", *big]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["dropped"] > 0 and got["compiled"] == [] and got["best"] is None
    assert not any(row["plan"] == "data=8" for row in got["analytic"])  # unsplit: 19 GB
    assert any(row["plan"].startswith("data=8 fsdp") for row in got["analytic"])
    steps = [row["step_s"] for row in got["analytic"]]
    assert steps == sorted(steps)


def test_a_compiled_estimate_reads_the_tpu_compilers_program():
    """DP over v5e:2x4: the compiled step's bytes are the contract's (it holds there) and its
    matmul FLOPs the paper count's, give or take what the paper leaves out (the TPU compiler
    writes the batched attention matmuls as convolutions over the batch dims: counted once)."""
    from shardkit.run import config

    devices = target.topology_devices("v5e:2x4")
    dp = Plan({"data": 8})
    found = planner.facts(config.build(CFG, dp, 16, devices), 16)
    compiled = planner.from_facts(CFG, dp, found, V5E)
    paper = planner.analytic(CFG, dp, 16, V5E)
    assert compiled.compiled and compiled.fits and compiled.contract_ok
    assert compiled.bytes_sent == pytest.approx(paper.bytes_sent)
    assert compiled.compute_s == pytest.approx(paper.compute_s, rel=0.25)
    assert compiled.fit is not None and compiled.fit.device_kind == "TPU v5 lite"


def test_compiled_plans_are_ranked_and_cached(tmp_path):
    """The best plans on paper compiled for v5e:2x4 until one fits, fitting ones first by
    estimated time; a second ranking takes every compiled plan's facts from the cache."""
    lines: list[str] = []
    kwargs = dict(keep=1, cache=planner.Cache(tmp_path), echo=lines.append)
    first = planner.rank(CFG, "v5e:2x4", 16, Plan(), **kwargs)
    best = first.best()
    assert best is not None and best.compiled and best.fits
    assert best.contract_ok is not None and best.compile_s > 0
    assert first.compiled[0] == best and first.analytic  # the rest stay on paper
    assert not any("cached" in line for line in lines)
    lines.clear()
    again = planner.rank(CFG, "v5e:2x4", 16, Plan(), **kwargs)
    assert again.compiled == first.compiled
    assert lines and all("cached" in line for line in lines)
    assert len(list(tmp_path.iterdir())) == len(first.compiled)


def test_the_command_prints_the_ranking_and_its_assumptions(capsys, tmp_path):
    argv = ["plan", "--target", "v5e:2x4", "--keep", "1", "--cache", str(tmp_path), *SMALL]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    assert "TFLOP/s per chip by step size (ViT train steps measured on one v5e" in out.out
    assert "GB/s per chip" in out.out
    assert "best: " in out.out and "compiled" in out.out
    assert "[1] " in out.err  # one progress line per compile
    assert cli.main([*argv, "--markdown"]) == 0
    table = capsys.readouterr().out
    assert "| rank | plan | from |" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--keep", "-1"], "--keep must be 0 or more"),
        (["--model", "gpt"], "plan ranks the ViT's plans"),
        (["--target", "v9z:1x1"], "libtpu does not know the topology 'v9z:1x1'"),
    ],
)
def test_bad_requests_are_one_sentence(capsys, argv, message):
    base = ["plan", "--target", "v5e:2x4", "--keep", "0", "--cache", "none", *SMALL]
    assert cli.main([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_no_candidate_is_one_sentence(monkeypatch):
    monkeypatch.setattr(planner, "candidates", lambda *args: [])
    with pytest.raises(
        PlanError, match="No plan of the planner's families runs this ViT at batch 16"
    ):
        planner.rank(CFG, "v5e:2x4", 16, Plan(), keep=0)


def test_the_chip_throughput_is_the_measured_steps_interpolated():
    """At each measured step the v5e's throughput is that step's (FLOPs over its seconds),
    between them interpolated in log FLOPs, clamped outside; unrolled layers 1.33x faster;
    other kinds scaled by their peak and marked assumed."""
    for flops, seconds in planner.V5E_SCAN_STEPS:
        assert V5E.step_flops(flops) == pytest.approx(flops / seconds)
    (f0, s0), (f1, s1) = planner.V5E_SCAN_STEPS[:2]
    middle = V5E.step_flops(math.sqrt(f0 * f1))
    assert middle == pytest.approx((f0 / s0 + f1 / s1) / 2)
    assert V5E.step_flops(1e9) == V5E.step_flops(f0)  # clamped below
    assert V5E.step_flops(1e15) == pytest.approx(planner.V5E_SCAN_STEPS[-1][0] / 0.31739)
    assert V5E.step_flops(f0, "unrolled") == pytest.approx(f0 / 0.03527)
    v6e = planner.CHIPS["TPU v6 lite"]
    assert v6e.step_flops(f0) == pytest.approx(V5E.step_flops(f0) * 918 / 197)
    assert "measured" in V5E.source and "assumed" in v6e.source
    with pytest.raises(target.TargetError, match="no throughput and ICI figures"):
        planner.chip_of("TPU v99")


def test_a_plan_out_of_hbm_is_compiled_again_with_the_block_recomputed(monkeypatch):
    """The compiler's RESOURCE_EXHAUSTED on remat "none" makes the planner compile the same
    plan with "dots", then "full", before it moves to the next plan on paper; another compile
    error is not retried."""
    seen: list[str] = []
    fitted = {"device_kind": "TPU v5 lite", "hbm_bytes": 16 * 2**30, "peak_bytes": 2**30,
              "argument_bytes": 1, "temp_bytes": 1, "largest": [["f32[1]", 4]]}  # fmt: skip

    def fake_facts(model, batch, flags):
        seen.append(planner.label(model.plan))
        if model.plan.remat != "full":
            return {"error": "RESOURCE_EXHAUSTED: Ran out of memory on HBM", "compile_s": 1.0}
        return {"flops": 1e9, "bytes_sent": 0.0, "hidden_bytes": 0.0, "contract_ok": True,
                "fit": fitted, "compile_s": 1.0, "error": None}  # fmt: skip

    monkeypatch.setattr(planner, "facts", fake_facts)
    ranking = planner.rank(CFG, "v5e:2x4", 16, Plan(), keep=1, echo=lambda line: None)
    first = seen[0]
    assert seen == [first, f"{first} remat=dots", f"{first} remat=full"]
    best = ranking.best()
    assert best is not None and best.plan.remat == "full"
    assert [e.fits for e in ranking.compiled] == [True, False, False]
