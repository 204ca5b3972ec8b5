"""``shardkit bench --schedules``: one row per schedule the plan can run, its bubble read from
the schedule's table, and the compiled step's matmul FLOPs per stage equal across schedules
(ZB-H1 splits the backward without redoing it). No timing is asserted: the times are measured,
not tested."""

from __future__ import annotations

import json

import pytest

from shardkit import cli
from shardkit.parallel.pipeline import schedules
from shardkit.run import pipeline_bench

TINY = ["--dim", "32", "--depth", "4", "--heads", "4", "--mlp-dim", "64", "--batch", "16"]


def test_every_schedule_is_a_row_with_its_table_bubble_and_the_same_matmuls(capsys) -> None:
    argv = ["bench", "--schedules", "--mesh", "stage=2", "--microbatches", "4", *TINY]
    assert cli.main([*argv, "--steps", "1", "--warmup", "0", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["schedule"], r["virtual"]) for r in rows] == pipeline_bench.variants(2, 4, 4)
    assert {r["schedule"] for r in rows} == set(schedules.SCHEDULES)
    for r in rows:
        sched = schedules.phased(schedules.build(r["schedule"], 2, 4, r["virtual"]))
        assert r["form"] == ("branch" if r["schedule"] == "gpipe" else "phased")
        assert r["bubble"] == pytest.approx(sched.bubble()) and r["ticks"] == sched.ticks
        assert r["flops"] == pytest.approx(rows[0]["flops"], rel=0.02), r
        assert r["step_s"] > 0 and r["vs_gpipe"] > 0
    assert rows[0]["vs_gpipe"] == 1.0


def test_variants_skip_what_the_plan_cannot_run() -> None:
    assert pipeline_bench.variants(4, 2, 8) == [("gpipe", 1), ("1f1b", 1)]  # M < S: no zb
    assert ("interleaved", 2) not in pipeline_bench.variants(2, 4, 2)  # 2 layers, 4 chunks


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--schedules", "--mesh", "data=2"], "--schedules needs a stage axis"),
        (["bench", "--schedules", "--mesh", "stage=2", "--strategies", "DP"],
         "give no --strategies"),
        (["bench", "--model", "gpt", "--schedules"], "--schedules needs a plan with a stage"),
    ],
)  # fmt: skip
def test_schedules_misuse_is_one_line(argv, message, capsys) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
