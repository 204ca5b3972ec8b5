"""The examples run as a user runs them (``python examples/x.py``) and print agreement.

Each runs in a fresh interpreter (it sets its own CPU device count), with small flags so the
file stays well inside a minute on a 2-core box. The printed numbers are parsed and checked,
not just the exit code: an example that "passes" while printing a large error is a failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
NUMBER = r"[-+]?\d+(?:\.\d*)?(?:e[-+]?\d+)?"

pytestmark = pytest.mark.slow


def run_example(name: str, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *flags],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: two xdist workers share 2 cores
        cwd=ROOT,
        env=env,
        check=False,
    )


def ok_output(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_tp_mlp_own_model() -> None:
    out = ok_output(run_example("tp_mlp_own_model.py", "--tokens", "5", "--dim", "16"))
    loss_err, grad_err = re.search(
        rf"loss ({NUMBER}), worst gradient leaf \S+ ({NUMBER})", out
    ).groups()
    assert float(loss_err) <= TOL and float(grad_err) <= TOL, out
    assert "sharded == unsharded" in out
    # One Megatron region each for attention and MLP: 2 all-reduces forward (g, written), 2
    # backward (the transposes of f), none implicit.
    assert re.search(r"all-reduce\s+model\s+2\s+2\s+[\d,]+\s+written", out), out
    assert re.search(r"all-reduce\s+model\s+2\s+2\s+[\d,]+\s+transpose", out), out
    assert "implicit" not in out


def test_ring_attention_long_sequence() -> None:
    # 5 tokens on 8 devices: 3 blocks are pure padding, the hardest case for the masks.
    out = ok_output(run_example("ring_attention_long_sequence.py", "--tokens", "5", "--heads", "2"))
    for name in ("out", "dq", "dk", "dv"):
        err = re.search(rf"^\s+{name}\s+relative L2 error ({NUMBER})", out, re.M)
        assert err and float(err.group(1)) <= TOL, out
    assert "ring == plain" in out
    for kind in ("ring, custom VJP", "ring, autodiff", "unsharded"):
        assert re.search(rf"{kind}\s+{NUMBER} MiB", out), out


def test_train_vit_sharded_losses_agree() -> None:
    flags = ("--mesh", "data=2,seq=2,model=2", "--sp", "ring", "--fsdp", "--steps", "2")
    out = ok_output(run_example("train_vit_sharded.py", *flags))
    rows = re.findall(rf"^\s+(\d+)\s+({NUMBER})\s+({NUMBER})\s+{NUMBER}$", out, re.M)
    assert [int(step) for step, _, _ in rows] == [0, 1], out
    for _, ref_loss, loss in rows:
        assert abs(float(loss) - float(ref_loss)) <= TOL * abs(float(ref_loss)), out
    # Training moves the loss (the comparison is not of two frozen models).
    assert float(rows[1][1]) < float(rows[0][1]), out
    assert "losses agree" in out


def test_train_vit_sharded_bad_plan_exits_2() -> None:
    result = run_example("train_vit_sharded.py", "--mesh", "model=8", "--sp", "none")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: heads=4 is not divisible by model=8."
    assert "Traceback" not in result.stderr


def test_collectives_tour_rings_equal_builtins() -> None:
    out = ok_output(run_example("collectives_tour.py", "--devices", "3", "--width", "6"))
    assert out.count("after:") == 11 and out.count(": True") == 7, out
    for sent, formula in re.findall(rf"sent\s+({NUMBER}) B/device \(formula\s+({NUMBER})\)", out):
        assert float(sent) == float(formula), out
    assert "d0:[0, 1, 6, 7, 12, 13]" in out  # all_to_all moved block k of each device to k
    assert out.rstrip().endswith("bytes == formulas: True")


def test_train_vit_learns_digits() -> None:
    out = ok_output(run_example("train_vit.py", "--steps", "100", "--mesh", "data=4,model=2",
                                "--sp", "none"))  # fmt: skip
    rows = re.findall(rf"loss ({NUMBER})\s+grad_norm ({NUMBER})\s+test_accuracy ({NUMBER})", out)
    assert len(rows) == 2, out
    assert float(rows[-1][0]) < float(rows[0][0]) and float(rows[-1][2]) >= 0.85, out


def test_verify_own_mlp_property_test_passes() -> None:
    out = ok_output(run_example("verify_own_mlp.py", "--examples", "8"))
    assert re.search(r"^8 examples on meshes of \[[\d, ]+\] devices: sharded == twin$", out, re.M)


def test_shard_own_model() -> None:
    """The "shard your own model" page's program: verified, contract-checked, then it learns."""
    out = ok_output(run_example("shard_own_model.py", "--steps", "60"))
    worst = float(re.search(rf"sharded == twin: worst \S+ at ({NUMBER})", out).group(1))
    assert worst <= TOL, out
    assert "contract holds" in out
    last = float(re.findall(rf"step\s+60\s+loss ({NUMBER})", out)[0])
    zero = float(re.search(rf"predicting 0 everywhere: loss ({NUMBER})", out).group(1))
    assert last < 0.6 * zero, out  # it learned the sequence means, not just to output ~0


def test_gpt() -> None:
    """The Llama-style decoder (RoPE, GQA, SwiGLU, vocab-parallel loss; causal zigzag ring, TP,
    DP) equals its twin and learns the text."""
    out = ok_output(run_example("gpt.py", "--steps", "60"))
    worst = float(re.search(rf"sharded == twin: worst \S+ at ({NUMBER})", out).group(1))
    assert worst <= TOL, out
    last = float(re.findall(rf"step\s+60\s+loss ({NUMBER})", out)[0])
    uniform = float(re.search(rf"uniform over \d+ characters: loss ({NUMBER})", out).group(1))
    assert last < 0.75 * uniform, out  # well below guessing
    assert "sample: 'Beautiful is" in out


def test_gpt_verifies_the_llama_plans() -> None:
    """docs/llama.md's five plans: data×model, ring-zigzag, Ulysses (striped) with KV repeat
    over model and Ulysses' own, FSDP, and data×seq×model; each ≤ 1e-5 against the twin."""
    out = ok_output(run_example("gpt.py", "--verify-plans"))
    worsts = [float(w) for w in re.findall(rf"worst \S+ at ({NUMBER})", out)]
    assert len(worsts) == 5 and max(worsts) <= TOL, out


def test_moe_block_own_model() -> None:
    """A user's MoE block on ShardedModel, ring-of-experts dispatch, capacity 0.5: equal to
    moe_ref, and the drops it reports are the reference's."""
    out = ok_output(run_example("moe_block.py", "--capacity-factor", "0.5", "--dispatch", "ring"))
    worst = float(re.search(rf"sharded == moe_ref: worst \S+ at ({NUMBER})", out).group(1))
    assert worst <= TOL, out
    got, want = re.search(r"dropped assignments: (\d+) \(reference (\d+)\)", out).groups()
    assert got == want and int(got) > 0, out


def test_moe_gpt_trains_under_ep_x_dp() -> None:
    """The GPT with 8 experts, top-2, capacity 1.25 on data=2 × expert=4: equal to its twin
    (the twin routing in the same groups), the loss falls, and the drops are reported."""
    out = ok_output(run_example("gpt.py", "--experts", "8", "--mesh", "data=2,expert=4",
                                "--layout", "contiguous", "--steps", "60"))  # fmt: skip
    worst = float(re.search(rf"sharded == twin: worst \S+ at ({NUMBER})", out).group(1))
    assert worst <= TOL, out
    first = float(re.findall(rf"step\s+1\s+loss ({NUMBER})", out)[0])
    last = float(re.findall(rf"step\s+60\s+loss ({NUMBER})", out)[0])
    assert last < 0.75 * first, out
    dropped = [float(d) for d in re.findall(rf"dropped\s+({NUMBER})%", out)]
    assert dropped and all(0 <= d < 100 for d in dropped), out
    counts = re.search(r"tokens per expert \(last step, all layers\): \[([\d, ]+)\]", out)
    per_expert = [int(c) for c in counts.group(1).split(",")]
    assert len(per_expert) == 8 and sum(per_expert) == 8 * 64 * 2 * 2, out  # B·T·k·layers


def test_moe_gpt_verifies_the_expert_plans() -> None:
    """EP = 8, EP × DP, EP × TP × DP, EP × FSDP, EP × zigzag ring: each ≤ 1e-5 against the twin."""
    out = ok_output(run_example("gpt.py", "--verify-plans", "--experts", "8"))
    worsts = [float(w) for w in re.findall(rf"worst \S+ at ({NUMBER})", out)]
    assert len(worsts) == 5 and max(worsts) <= TOL, out


def test_pipeline_mlp() -> None:
    """A user's MLP pipelined with 1F1B over 4 stages × data 2: equal to its twin, and it fits."""
    out = ok_output(run_example("pipeline_mlp.py", "--steps", "50"))
    worst = float(re.search(rf"pipelined == twin: worst \S+ at ({NUMBER})", out).group(1))
    assert worst <= TOL, out
    last = float(re.search(rf"step\s+50\s+loss ({NUMBER})", out).group(1))
    mean = float(re.search(rf"predicting the mean: loss ({NUMBER})", out).group(1))
    assert last < 0.25 * mean, out
    assert "stage 3: .  .  .  F0 B0" in out  # the schedule's table is printed
