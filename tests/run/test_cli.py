"""End-to-end tests of the ``shardkit`` command: the default matrix, --json, bad input."""

import json
import subprocess
import sys

import pytest

from shardkit import cli
from shardkit.mesh import Plan
from shardkit.run import verify


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardkit.cli", *argv], capture_output=True, text=True, timeout=600
    )


# Five of the default matrix's sixteen cases, one per family, keep this test inside CI's time;
# every case's strategy is proven equal (tests/models) and held to its contract elsewhere.
VERIFIED_HERE = ("DP×TP", "FSDP remat", "USP", "Megatron-SP×ring", "PP ZB×Ulysses")


@pytest.mark.slow
def test_verify_default_matrix_passes(capsys, monkeypatch):
    matrix = verify.default_matrix()
    names = [case.name for case in matrix]
    for strategy in ("DP", "TP", "DP×TP", "FSDP", "FSDP×TP", "Megatron-SP", "ring", "Ulysses",
                     "USP", "2×2×2 ring+TP+FSDP", "PP 1F1B×DP×TP", *VERIFIED_HERE):  # fmt: skip
        assert strategy in names
    subset = [case for case in matrix if case.name in VERIFIED_HERE]
    monkeypatch.setattr(verify, "default_matrix", lambda devices=8: subset)
    assert cli.main(["verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and [c["name"] for c in report["cases"]] == list(VERIFIED_HERE)
    for case in report["cases"]:
        assert set(case) >= {"name", "mesh", "sp", "fsdp", "ok", "errors", "tolerance"}
        assert set(case["errors"]) == {"logits", "grads", "step"}
        assert max(case["errors"].values()) <= case["tolerance"] == 1e-5
        # ops per (kind, axes), bytes and patterns (report.Report.contract_ok): the minimum
        assert case["contract_ok"] is True
        assert case["measured_bytes_sent"] == case["expected_bytes_sent"]


def test_matrix_overlap_names_each_plan_it_cannot_overlap_and_why():
    """``verify --overlap`` applies it wherever the plan allows and names the rest with the
    reason, ZeRO-1 pointing at ZeRO-2 (nothing compiles here)."""
    args = cli.build_parser().parse_args(["verify", "--overlap"])
    names = {case.name for case in cli.with_matrix_options(verify.default_matrix(), args)}
    assert {"DP +overlap", "TP +overlap", "ZeRO-2×TP +overlap", "Megatron-SP +overlap"} <= names
    assert "ZeRO-1×TP +overlap" in names  # its TP half-batches; the ZeRO-1 scatter stays after
    assert "FSDP remat (no overlap: --pp, --remat)" in names
    zero1 = "no overlap: ZeRO-1's scatter is after backward; --zero 2 overlaps"
    assert cli._no_overlap(Plan({"data": 2}, zero=1)) == zero1


def test_verify_one_plan_prints_a_table(capsys):
    argv = ["verify", "--mesh", "data=2,seq=2", "--devices", "4", "--sp", "ring", "--pool", "gap"]
    assert cli.main([*argv, "--depth", "2", "--dim", "32", "--heads", "4", "--batch", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["case", "mesh", "sp", "zero"]
    assert "data=2,seq=2,model=1" in out[1] and out[1].rstrip().endswith("✓")
    assert out[-1].startswith("1/1 cases match vit_ref")


SMALL = ["--depth", "2", "--dim", "32", "--heads", "4", "--batch", "4"]


def test_inspect_json_hlo_and_plot(tmp_path, capsys):
    hlo, png = tmp_path / "step.hlo", tmp_path / "pattern.png"
    argv = ["inspect", "--mesh", "data=2,seq=2", "--devices", "4", "--sp", "ulysses", *SMALL]
    assert cli.main([*argv, "--json", "--hlo", str(hlo), "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"collectives", "measured_bytes_sent", "expected_bytes_sent", "memory"}
    assert set(report["memory"]) >= {"argument", "output", "temp"}
    kinds = {row["kind"] for row in report["collectives"]}
    assert "all-to-all" in kinds
    for row in report["collectives"]:
        assert set(row) >= {"kind", "axes", "count", "bytes_sent"}
        assert row["count"] == row["expected_count"]
    assert report["measured_bytes_sent"] == pytest.approx(report["expected_bytes_sent"], rel=0.01)
    assert "all-to-all" in hlo.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_table(capsys):
    assert cli.main(["inspect", "--mesh", "data=2,model=2", "--devices", "4", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "all-reduce" in out and "measured / expected bytes: 1.0000" in out
    assert "contract: ✓ holds" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mesh", "data=3", "--devices", "8"], "uses 3 devices but --devices is 8"),
        (
            ["--mesh", "data=2,model=4", "--heads", "6", "--dim", "48"],
            "heads=6 is not divisible by model=4",
        ),
        (["--mesh", "data=8", "--batch", "12"], "batch=12 is not divisible by data=8"),
        (["--mesh", "data=2,model=4", "--mlp-dim", "6"], "mlp_dim=6 is not divisible by model=4"),
        (["--mesh", "data=2,pipeline=4"], "Unknown mesh axis 'pipeline'"),
        (["--mesh", "data=8", "--sp", "ring"], "the mesh has seq=1"),
        (
            ["--mesh", "seq=8", "--sp", "ulysses", "--heads", "4", "--dim", "32"],
            "divisible by seq=8",
        ),
        (["--mesh", "seq=8", "--sp", "usp", "--ulysses", "3"], "Ulysses degree 3"),
        (["--sp", "bogus"], "invalid choice: 'bogus'"),
        (["--variant", "G/14"], "Unknown ViT variant 'G/14'"),
        (["--image", "30"], "image=30 is not divisible by ViTConfig.patch=4"),
        (["--mesh", "data=4,stage=2"], "The mesh has stage=2 but no pipeline schedule"),
        (["--mesh", "data=8", "--pp", "1f1b"], "--pp 1f1b needs a stage axis of size > 1"),
        (
            ["--mesh", "stage=8", "--pp", "gpipe", "--depth", "4"],
            "depth=4 is not divisible by stage×virtual = 8×1",
        ),
        (
            ["--mesh", "data=2,stage=4", "--pp", "1f1b", "--depth", "4", "--microbatches", "3"],
            "The data-local batch (16//2=8) is not divisible by --microbatches 3",
        ),
        (
            ["--mesh", "stage=8", "--pp", "zb", "--depth", "8", "--microbatches", "4"],
            "at least as many microbatches as stages (M=4 < S=8)",
        ),
        (
            ["--mesh", "stage=8", "--pp", "1f1b", "--depth", "8", "--virtual", "2"],
            "--virtual 2 only applies to --pp interleaved, not --pp 1f1b",
        ),
        (["--mesh", "data=8", "--virtual", "2"], "--virtual 2 only applies with --pp interleaved"),
        (["--mesh", "data=8", "--microbatches", "0"], "--microbatches must be a positive"),
        (["--pp", "pipedream"], "invalid choice: 'pipedream'"),
        (
            ["--mesh", "model=8", "--zero", "1"],
            "--zero 1 splits over data, but the mesh has data=1",
        ),
        (["--mesh", "data=8", "--zero", "2", "--fsdp"], "--fsdp is ZeRO-3 but --zero 2"),
        (
            ["--mesh", "data=8", "--zero", "1", "--dim", "36", "--heads", "4"],
            "dim=36 is not divisible by data=8 (ZeRO-1 splits the embed axis over data)",
        ),
        (
            ["--mesh", "data=2,stage=4", "--pp", "1f1b", "--depth", "4", "--zero", "2"],
            "--zero 2 cannot run under --pp 1f1b",
        ),
        (["--zero", "4"], "invalid choice: 4"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_2(argv, message, capsys):
    assert cli.main(["verify", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardkit: error: ")
    assert message in lines[0]


def test_zero_names_the_leaves_it_keeps_whole(capsys):
    """Not an error: ZeRO-1/2 keep the leaves with no embed dim (biases) whole, and say so."""
    argv = ["inspect", "--mesh", "data=2,model=2", "--devices", "4", "--zero", "1", *SMALL]
    assert cli.main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["zero"] == 1
    (note,) = captured.err.strip().splitlines()
    assert note.startswith("shardkit: note: ZeRO-1 keeps 5 leaves whole on every device")
    assert "blocks/mlp/fc1/bias" in note and "head/bias" in note


def test_bad_input_from_a_fresh_process_has_no_traceback():
    result = run_cli("verify", "--mesh", "data=2,model=4", "--heads", "6", "--dim", "48")
    assert result.returncode == 2
    assert result.stderr.strip() == "shardkit: error: heads=6 is not divisible by model=4."
    assert "Traceback" not in result.stderr and result.stdout == ""
