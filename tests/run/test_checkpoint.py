"""Checkpoints (``shardkit.run.checkpoint``): restored onto other plans bitwise, kill-and-resume
equal to an uninterrupted run, damaged checkpoints skipped by name, runs that do not fit refused."""

from __future__ import annotations

import json
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

import vit_ref
from shardkit import cli
from shardkit.mesh import Plan, to_host
from shardkit.models.vit import ShardedViT
from shardkit.run import checkpoint

CFG = vit_ref.ViTConfig(image=8, patch=2, channels=1, classes=10, dim=32, depth=2, heads=4,
                        mlp_dim=64, pool="tok")  # fmt: skip
SAVED = Plan({"data": 4, "model": 2})
RESTORED = {
    "FSDP over 8": Plan({"data": 8}, fsdp=True),
    "2×2×2 ring": Plan({"data": 2, "seq": 2, "model": 2}, sp="ring"),
    "ZeRO-1×TP": Plan({"data": 4, "model": 2}, zero=1),
}


def state_of(plan: Plan, seed: int = 0):
    model = ShardedViT(CFG, plan)
    optimizer = optax.adamw(1e-3)
    params = model.shard(vit_ref.init(jax.random.key(seed), CFG))
    state = {"params": params, "opt_state": model.init_opt_state(optimizer, params)}
    # one non-trivial optimizer state: mu and nu filled with values that differ per leaf
    state["opt_state"] = jax.tree.map(lambda x: x + 0.25 if x.dtype == np.float32 else x,
                                      state["opt_state"])  # fmt: skip
    return state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    saver = checkpoint.Checkpointer(directory, every=1, keep=3)
    state = state_of(SAVED)
    for step in (1, 2):
        saver.save(step, state, {"step": step, "model": {"dim": CFG.dim}})
    saver.close()
    return directory, to_host(state)


@pytest.mark.parametrize("name", list(RESTORED))
def test_restore_onto_another_plan_is_bitwise_and_placed_by_it(name, saved) -> None:
    directory, expected = saved
    target = state_of(RESTORED[name], seed=1)  # other values, the new plan's shardings
    restored = checkpoint.restore(directory, 2, checkpoint.abstract_like(target))
    for got, want, like in zip(jax.tree.leaves(restored), jax.tree.leaves(expected),
                               jax.tree.leaves(target), strict=True):  # fmt: skip
        assert np.array_equal(to_host(got), want)
        assert got.sharding == like.sharding


def flip_a_byte(step_dir: pathlib.Path) -> None:
    path = max((p for p in step_dir.rglob("*") if p.is_file() and p.name != checkpoint.MANIFEST),
               key=lambda p: p.stat().st_size)  # fmt: skip
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_damaged_newest_falls_back_to_the_previous_by_name(saved, tmp_path, capsys) -> None:
    directory = tmp_path / "checkpoints"
    shutil.copytree(saved[0], directory)
    assert checkpoint.newest_valid(directory) == 2
    flip_a_byte(directory / "2")
    assert checkpoint.newest_valid(directory) == 1
    assert "checkpoints/2 is corrupted" in capsys.readouterr().err
    # A save that never finished (killed after orbax's rename, before the manifest): skipped.
    (directory / "3").mkdir()
    assert checkpoint.newest_valid(directory) == 1
    assert "checkpoints/3 is incomplete" in capsys.readouterr().err
    big = max(
        (p for p in (directory / "1").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    big.write_bytes(big.read_bytes()[:-3])
    with pytest.raises(checkpoint.CheckpointError, match="all 3 are damaged"):
        checkpoint.newest_valid(directory)
    assert "checkpoints/1 is truncated" in capsys.readouterr().err


def test_missing_or_empty_directories_say_which(tmp_path) -> None:
    with pytest.raises(checkpoint.CheckpointError, match="No checkpoint directory"):
        checkpoint.newest_valid(tmp_path / "nowhere")
    with pytest.raises(checkpoint.CheckpointError, match="holds no checkpoints"):
        checkpoint.newest_valid(tmp_path)


TRAIN = ["train", "--data", "digits", "--dim", "32", "--heads", "4", "--mlp-dim", "64",
         "--batch", "32", "--steps", "12", "--eval-every", "3", "--cache", "none",
         "--checkpoint-every", "2", "--keep", "2"]  # fmt: skip


def records(out: pathlib.Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(ln).items() if k != "images_per_s"} for ln in lines]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> pathlib.Path:
    """A 12-step DP×TP run, checkpointed every 2 steps, never stopped."""
    out = tmp_path_factory.mktemp("whole")
    assert cli.main([*TRAIN, "--mesh", "data=4,model=2", "--out", str(out)]) == 0
    return out


def test_a_checkpoint_of_another_model_is_refused_by_field(uninterrupted, tmp_path, capsys) -> None:
    bad = [*TRAIN, "--dim", "16", "--mesh", "data=8", "--resume", str(uninterrupted), "--out",
           str(tmp_path / "x")]  # fmt: skip
    assert cli.main(bad) == 2
    assert "is from another run: its model has dim=32, this run's is 16" in capsys.readouterr().err


def test_resuming_stacked_blocks_as_per_layer_ones_is_one_sentence(
    uninterrupted, tmp_path, capsys
) -> None:
    """``--layers list`` keeps each layer's params in their own arrays: another tree than a
    stacked checkpoint's, refused by name instead of failing inside orbax."""
    bad = [*TRAIN, "--mesh", "data=4,model=2", "--layers", "list", "--resume",
           str(uninterrupted), "--out", str(tmp_path / "x")]  # fmt: skip
    assert cli.main(bad) == 2
    err = capsys.readouterr().err
    assert "holds stacked blocks (--layers scan) and this run keeps them per-layer" in err, err


def killed_mid_save(flags: list[str], out: pathlib.Path, after: int) -> int:
    """Runs ``shardkit train`` in a child process and SIGKILLs it while it is writing the first
    checkpoint after step ``after`` (orbax's temporary directory exists: the save has begun and
    not finished). Returns the step whose save was cut."""
    command = [sys.executable, "-m", "shardkit.cli", *flags, "--out", str(out)]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    where, deadline = out / "checkpoints", time.monotonic() + 180
    try:
        while child.poll() is None and time.monotonic() < deadline:
            cut = [int(p.name.split(".")[0]) for p in where.glob("*.orbax-checkpoint-tmp*")]
            cut = [step for step in cut if step > after]
            if cut:
                child.send_signal(signal.SIGKILL)
                child.wait()
                return cut[0]
            time.sleep(0.001)
    finally:
        child.kill()
        _, err = child.communicate()
    pytest.fail(f"the run ended ({child.returncode}) before it could be killed: {err[-1000:]}")


@pytest.mark.slow
def test_a_run_killed_mid_save_resumes_equal_to_the_uninterrupted_run(
    uninterrupted, tmp_path, capsys
) -> None:
    """A real SIGKILL while step K's checkpoint is being written: the previous checkpoint is
    intact; resumed on the same plan, the records and final params are bitwise the uninterrupted
    run's; resumed under FSDP over 8, the records match to float32 rounding."""
    cut = tmp_path / "cut"
    killed_at = killed_mid_save([*TRAIN, "--mesh", "data=4,model=2"], cut, after=4)
    assert (cut / "metrics.jsonl").read_text().count("\n") < 12  # killed mid-run, not at the end
    shutil.copytree(cut, tmp_path / "cut-fsdp")
    assert cli.main([*TRAIN, "--mesh", "data=4,model=2", "--resume", str(cut)]) == 0
    assert f"resuming from step {killed_at - 2} of 12" in capsys.readouterr().err
    assert records(cut) == records(uninterrupted)
    final = [checkpoint.restore(d / "checkpoints", 12, None) for d in (uninterrupted, cut)]
    for a, b in zip(jax.tree.leaves(final[0]), jax.tree.leaves(final[1]), strict=True):
        assert np.array_equal(a, b)
    # Under another plan: the same run to float32 rounding.
    other = tmp_path / "cut-fsdp"
    assert cli.main([*TRAIN, "--mesh", "data=8", "--fsdp", "--resume", str(other)]) == 0
    assert [r["step"] for r in records(other)] == list(range(1, 13))
    for a, b in zip(records(other), records(uninterrupted), strict=True):
        for key in set(b) & {"loss", "grad_norm", "test_loss", "test_accuracy"}:
            assert a[key] == pytest.approx(b[key], rel=1e-5)
