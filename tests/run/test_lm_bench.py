"""``shardkit bench --model moe-gpt`` (``run.lm_bench``): the hand-sharded decoder, XLA's
partitioner on the twin (GShard's MoE recipe) and one device take the same step.

The three compute the same function on an EP × DP plan that drops tokens (the same routing
groups and capacities), so their first losses agree to float32 rounding; the hand step sends
exactly its contract's bytes, and the row carries every key the CLI's JSON promises."""

from __future__ import annotations

import pytest

from shardkit.models import gpt
from shardkit.parallel import moe
from shardkit.run import lm, lm_bench


@pytest.fixture(scope="module")
def result():
    cfg = gpt.moe_config(moe.MoE(8, 2, 0.75))
    plans = {"EP×DP": lm.plan("data=2,expert=4", None, False)}
    return lm_bench.run(cfg, plans, batch=8, steps=1, warmup=0)


def test_three_contenders_compute_the_same_step(result):
    row = result["rows"][0]
    assert row["shardkit_loss"] == pytest.approx(row["single_device_loss"], abs=1e-5)
    assert row["auto_loss"] == pytest.approx(row["single_device_loss"], abs=1e-5)


def test_the_hand_step_sends_its_contract_and_auto_is_measured(result):
    row = result["rows"][0]
    assert row["contract_ok"]
    assert row["shardkit_bytes_sent"] == row["expected_bytes_sent"] > 0
    assert row["auto_bytes_sent"] > 0 and row["auto_temp_bytes"] > 0
    for key in ("strategy", "shardkit_step_s", "auto_step_s", "single_device_step_s",
                "ratio_vs_auto", "shardkit_bytes_sent", "auto_bytes_sent"):  # fmt: skip
        assert row[key] is not None, key
    assert result["model"] == "moe-gpt" and result["experts"]["experts"] == 8


def test_table_shows_the_losses(result):
    table = lm_bench.format_table(result)
    assert table.splitlines()[0].split()[:4] == ["strategy", "mesh", "loss", "auto"]
    assert "EP×DP" in table
