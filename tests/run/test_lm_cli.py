"""``shardkit verify | inspect | train | bench --model gpt / moe-gpt``: the decoder through
the command line — sharded == twin, the step's contract from ``models.gpt.cost``, a training
run's files — and every flag that does not apply to it refused in one line, exit 2."""

from __future__ import annotations

import json

import pytest

from shardkit import cli


def test_verify_moe_gpt_one_plan_json(capsys):
    argv = ["verify", "--model", "moe-gpt", "--mesh", "data=2,expert=4", "--capacity-factor",
            "0.5", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ok"] and got["model"] == "moe-gpt" and len(got["cases"]) == 1
    case = got["cases"][0]
    assert case["mesh"] == "data=2,expert=4,seq=1,model=1"
    assert max(case["errors"].values()) <= case["tolerance"] == 1e-5


def test_inspect_moe_gpt_holds_its_contract(capsys):
    argv = ["inspect", "--model", "moe-gpt", "--mesh", "expert=2,seq=4", "--sp", "ring", "--json"]
    assert cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["contract_ok"], got["mismatches"]
    assert got["ratio"] == pytest.approx(1.0, abs=1e-4)
    kinds = {(c["kind"], tuple(c["axes"])) for c in got["collectives"]}
    assert ("all-to-all", ("expert",)) in kinds and ("collective-permute", ("seq",)) in kinds
    assert sum(got["tokens_per_expert"]) == 16 * 64 * 2 * 2  # B·T·k·layers, all routed
    assert got["dropped"] == pytest.approx(got["dropped_fraction"] * 16 * 64 * 2 * 2)


@pytest.mark.parametrize(
    "argv",
    [["--model", "gpt", "--mesh", "data=2,seq=4", "--sp", "ring"],
     ["--model", "gpt", "--mesh", "seq=2,model=4", "--sp", "ulysses"],
     ["--model", "moe-gpt", "--mesh", "expert=2,seq=4", "--sp", "ring"],
     ["--model", "gpt", "--mesh", "data=2,stage=2,seq=2", "--sp", "ring", "--depth", "4",
      "--pp", "zbv", "--microbatches", "2"]],
)  # fmt: skip
def test_packed_documents_verify(argv, capsys):
    """--documents: each line a document (the ring and Ulysses carry the segment ids, RoPE
    the per-document positions, the loss divides by the real targets): equal to the twin;
    pipelined (ZBV, a zigzag ring inside the stages), the ids and positions side inputs."""
    assert cli.main(["verify", *argv, "--documents", "--json"]) == 0
    case = json.loads(capsys.readouterr().out)["cases"][0]
    assert case["ok"] and max(case["errors"].values()) <= 1e-5, case


def test_inspect_dense_gpt_table(capsys):
    assert cli.main(["inspect", "--model", "gpt", "--mesh", "data=2,model=4"]) == 0
    out = capsys.readouterr().out
    assert "contract: ✓ holds" in out and "measured / expected bytes: 1.0000" in out


def test_train_moe_gpt_writes_its_run(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", "moe-gpt", "--mesh", "data=2,expert=4", "--steps", "20",
            "--lr", "1e-2", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 20 and records[-1]["loss"] < records[0]["loss"]
    assert sum(records[-1]["tokens_per_expert"]) == 8 * 64 * 2 * 2  # B·T·k·layers
    assert 0 <= records[-1]["dropped_fraction"] < 1
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == "moe-gpt" and config["experts"]["experts"] == 8
    assert (out / "curves.png").stat().st_size > 0
    assert "step 20: loss" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--model", "gpt", "--chip"], "--chip applies to the ViT only"),
        (["bench", "--model", "moe-gpt", "--strategies", "nope"], "unknown strategy 'nope'"),
        (["bench", "--model", "gpt", "--mesh", "data=8", "--strategies", "FSDP"],
         "give either --strategies or plan options"),
        (["bench", "--model", "gpt", "--steps", "0"], "--steps must be >= 1"),
        (["verify", "--documents"], "--documents applies to --model gpt or moe-gpt"),
        (["verify", "--tied"], "--tied applies to --model gpt or moe-gpt"),
        (["verify", "--model", "gpt", "--heads", "3"], "dim=64 does not split into heads=3"),
        (["verify", "--model", "gpt", "--depth", "0"], "layers must be positive integers"),
        (["verify", "--model", "gpt", "--mesh", "stage=2", "--pp", "zbv"],
         "layers=2 do not split into stage×virtual=4 chunks"),
        (["verify", "--model", "gpt", "--experts", "4"], "--experts needs --model moe-gpt"),
        (["train", "--model", "gpt", "--capacity-factor", "2"],
         "--capacity-factor needs --model moe-gpt"),
        (["verify", "--model", "moe-gpt", "--mesh", "expert=3"],
         "experts=8 is not divisible by expert=3"),
        (["verify", "--model", "gpt", "--mesh", "expert=2"],
         "The mesh has expert=2 but the GPT has no experts"),
        (["verify", "--model", "moe-gpt", "--top-k", "9"], "top_k must be in 1..experts=8"),
        (["verify", "--model", "moe-gpt", "--capacity-factor", "lots"],
         "--capacity-factor must be a number or none"),
        (["verify", "--model", "gpt", "--variant", "mu"], "--variant applies to the ViT only"),
        (["inspect", "--model", "gpt", "--pp", "gpipe"], "--pp gpipe needs a stage axis"),
        (["verify", "--model", "gpt", "--mesh", "stage=2"], "The mesh has stage=2; give --pp"),
        (["verify", "--model", "gpt", "--microbatches", "2"], "--microbatches and --virtual need"),
        (["verify", "--model", "gpt", "--mesh", "stage=2", "--pp", "1f1b", "--microbatches", "0"],
         "--microbatches and --virtual must be positive"),
        (["verify", "--model", "gpt", "--sp", "megatron", "--mesh", "model=2"],
         "--sp megatron does not apply to the GPT"),
        (["verify", "--model", "gpt", "--mesh", "data=3"], "batch=16 is not divisible by"),
    ],
)  # fmt: skip
def test_lm_mistakes_are_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_vit_refuses_an_expert_axis(capsys):
    assert cli.main(["verify", "--mesh", "data=2,expert=2", "--devices", "4"]) == 2
    assert "the ViT has no experts" in capsys.readouterr().err
