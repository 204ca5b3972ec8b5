"""``shardkit bench``: its rows, its contenders (auto really is XLA's partitioner, and really
splits tokens for the sequence modes), its FLOP count, and its errors. No timing is asserted:
the numbers are measured, not tested."""

from __future__ import annotations

import json
import math
import re

import jax
import numpy as np
import pytest

import vit_ref
from shardkit import cli
from shardkit.mesh import Plan
from shardkit.run import bench
from shardkit.run.verify import Case, make_batch

TINY = ["--dim", "32", "--depth", "2", "--heads", "8", "--mlp-dim", "64", "--batch", "16"]
CFG = vit_ref.ViTConfig(
    image=32, patch=4, channels=3, classes=10, dim=32, depth=2, heads=8, mlp_dim=64, pool="tok",
    head_zeroinit=False,
)  # fmt: skip
FIELDS = {
    "strategy", "shardkit_step_s", "auto_step_s", "single_device_step_s", "ratio_vs_auto",
    "shardkit_bytes_sent", "auto_bytes_sent", "expected_bytes_sent", "ratio_vs_single_device",
    "shardkit_step_min_s", "shardkit_step_max_s", "auto_step_min_s", "auto_step_max_s",
    "shardkit_argument_bytes", "shardkit_temp_bytes", "auto_argument_bytes", "auto_temp_bytes",
    "shardkit_compile_s", "auto_compile_s", "model_flops", "shardkit_flops_per_s",
    "shardkit_mfu", "auto_mfu", "single_device_mfu", "peak_flops_per_s", "auto_error",
}  # fmt: skip


@pytest.mark.slow
def test_bench_json_rows_and_the_bytes_target(capsys, tmp_path) -> None:
    png = tmp_path / "bench.png"
    argv = ["bench", *TINY, "--strategies", "DP,FSDP,ring,ulysses", "--steps", "2"]
    assert cli.main([*argv, "--warmup", "0", "--json", "--plot", str(png)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["strategy"] for r in result["rows"]] == ["DP", "FSDP", "ring", "Ulysses"]
    for row in result["rows"]:
        assert set(row) >= FIELDS and row["auto_error"] is None, row
        assert row["shardkit_bytes_sent"] == pytest.approx(row["expected_bytes_sent"], rel=0.01)
        assert row["shardkit_bytes_sent"] <= row["auto_bytes_sent"] * 1.0001, row["strategy"]
        assert row["shardkit_step_min_s"] <= row["shardkit_step_s"] <= row["shardkit_step_max_s"]
        assert row["ratio_vs_auto"] == row["shardkit_step_s"] / row["auto_step_s"]
        assert 0 < row["shardkit_mfu"] < 1 and row["model_flops"] == bench.model_flops(CFG, 16)
    fsdp = result["rows"][1]
    assert fsdp["shardkit_argument_bytes"] < result["rows"][0]["shardkit_argument_bytes"] / 4
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("sp", ["ring", "ulysses"])
def test_auto_is_the_partitioner_and_splits_tokens(sp) -> None:
    plan = Plan({"data": 2, "seq": 4}, sp=sp)
    params = vit_ref.init(jax.random.key(0), CFG)
    data = tuple(np.asarray(a) for a in make_batch(CFG, 16))
    ours = bench.shardkit_contender(CFG, plan, params, data)
    auto = bench.auto_contender(CFG, plan, params, data)
    assert "sdy.manual_computation" in ours.program  # shardkit's step is one shard_map
    assert "sdy.manual_computation" not in auto.program  # auto's has none: XLA partitions it
    assert "sdy.sharding_constraint" in auto.program  # the token split it was asked for
    assert auto.ledger is not None
    seq_ops = [k for k in auto.ledger.summary() if "seq" in k[1]]
    assert seq_ops, auto.ledger.summary()  # and it really split the tokens over seq


def test_model_flops_is_the_paper_count() -> None:
    d, f, o, t, b, p = CFG.dim, CFG.mlp_dim, CFG.classes, CFG.num_tokens, 16, CFG.patch_features
    per_layer = 4 * d * d + 2 * d * f  # q, k, v, out projections; fc1, fc2
    want = 6 * ((p * d + CFG.depth * per_layer) * b * t + d * o * b)
    want += 12 * b * t * t * d * CFG.depth
    assert bench.model_flops(CFG, b) == want
    assert math.isclose(bench.model_flops(CFG, 2 * b), 2 * want)


def test_a_failing_auto_is_reported_in_its_row(monkeypatch) -> None:
    def broken(*_args, **_kwargs):
        raise RuntimeError("INTERNAL: the partitioner gave up\nsecond line")

    monkeypatch.setattr(bench, "auto_train_step", broken)
    result = bench.run(CFG, [Case("DP", Plan({"data": 2}))], 16, steps=1, warmup=0)
    (row,) = result["rows"]
    assert row["auto_error"] == "INTERNAL: the partitioner gave up"
    assert row["auto_step_s"] is None and row["shardkit_step_s"] > 0
    assert "auto failed on DP: INTERNAL: the partitioner gave up" in bench.format_table(result)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--strategies", "DP,warp"], "unknown strategy 'warp'; choose from DP, TP,"),
        (["--steps", "0"], "--steps must be >= 1"),
        (
            ["--mesh", "model=8", "--heads", "4", "--dim", "64"],
            "heads=4 is not divisible by model=8",
        ),
        (["--mesh", "data=8", "--strategies", "DP"], "either --strategies or plan options"),
    ],
)
def test_bad_input_is_one_line_exit_2(flags, message, capsys) -> None:
    assert cli.main(["bench", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_chip_bench_reports_both_models_per_batch_and_policy(capsys) -> None:
    """``bench --chip`` on whatever device 0 is: a row per (batch, remat, model), with
    throughput, MFU and memory from the compiled step."""
    flags = ["--image", "16", "--patch", "8", "--dim", "32", "--depth", "1", "--heads", "2",
             "--mlp-dim", "64", "--classes", "5", "--steps", "1", "--warmup", "0"]  # fmt: skip
    assert cli.main(["bench", "--chip", *flags, "--batches", "2,4", "--remats", "none,dots",
                     "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    assert [(r["batch"], r["remat"], r["model"]) for r in rows] == [
        (b, p, m) for b in (2, 4) for p in ("none", "dots") for m in ("vit_ref", "shardkit")
    ]
    for r in rows:
        assert r["error"] is None and r["images_per_s"] > 0 and r["temp_bytes"] > 0
        assert r["mfu"] > 0 and r["peak_bytes"] >= r["temp_bytes"] and r["microbatches"] == 1


def test_chip_bench_accumulates_batches_over_the_micro_batch(capsys) -> None:
    """``--micro-batch 2``: batch 4 runs as 2 micro-batches of 2 in both models, batch 2 whole;
    the table says so (2×2). Both models on per-layer params (``--layers list``)."""
    flags = ["--image", "16", "--patch", "8", "--dim", "32", "--depth", "2", "--heads", "2",
             "--mlp-dim", "64", "--classes", "5", "--steps", "1", "--warmup", "0"]  # fmt: skip
    assert cli.main(["bench", "--chip", *flags, "--batches", "2,4", "--remats", "none",
                     "--micro-batch", "2", "--layers", "list"]) == 0  # fmt: skip
    table = capsys.readouterr().out
    rows = table.splitlines()[2:]
    splits = [re.search(r" (\d+×\d+) ", line).group(1) for line in rows]
    assert splits == ["2×1"] * 2 + ["2×2"] * 2
    assert all(" list " in line for line in rows), table


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--remats", "some"], "--remats takes policies of none, dots, full"),
        (["--batches", "0"], "--batches takes positive integers"),
        (["--mesh", "data=2"], "--chip runs one device"),
        (["--batches", "6", "--micro-batch", "4"], "batch 6 is not a multiple of --micro-batch 4"),
        (["--micro-batch", "0"], "--micro-batch must be a positive integer"),
    ],
)
def test_chip_bench_refuses_bad_flags(flags, message, capsys) -> None:
    assert cli.main(["bench", "--chip", *flags]) == 2
    assert message in capsys.readouterr().err
