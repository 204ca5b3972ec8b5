"""Checkpoints (``shardkit.run.checkpoint``): restored onto other plans bitwise, kill-and-resume
equal to an uninterrupted run, damaged checkpoints skipped by name, runs that do not fit refused."""

from __future__ import annotations

import json
import pathlib

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
    import shutil

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
         "--batch", "32", "--steps", "6", "--eval-every", "3", "--cache", "none",
         "--checkpoint-every", "2"]  # fmt: skip


def records(out: pathlib.Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(ln).items() if k != "images_per_s"} for ln in lines]


def test_resume_equals_the_uninterrupted_run_and_refuses_another_model(tmp_path, capsys) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert cli.main([*TRAIN, "--mesh", "data=4,model=2", "--out", str(whole)]) == 0
    assert cli.main([*TRAIN, "--mesh", "data=4,model=2", "--out", str(cut)]) == 0
    # As if killed after step 4's checkpoint: step 6's was never completed.
    (cut / "checkpoints" / "6" / checkpoint.MANIFEST).unlink()
    assert cli.main([*TRAIN, "--mesh", "data=4,model=2", "--resume", str(cut)]) == 0
    assert records(cut) == records(whole)
    final = [checkpoint.restore(d / "checkpoints", 6, None) for d in (whole, cut)]
    for a, b in zip(jax.tree.leaves(final[0]), jax.tree.leaves(final[1]), strict=True):
        assert np.array_equal(a, b)
    # Under another plan: the same run to float32 rounding.
    other = tmp_path / "other"
    assert cli.main([*TRAIN, "--mesh", "data=8", "--fsdp", "--resume", str(whole), "--out",
                     str(other)]) == 0  # fmt: skip
    assert [r["step"] for r in records(other)] == list(range(1, 7))
    for a, b in zip(records(other), records(whole), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    capsys.readouterr()
    bad = [
        *TRAIN,
        "--dim",
        "16",
        "--mesh",
        "data=8",
        "--resume",
        str(whole),
        "--out",
        str(tmp_path / "x"),
    ]
    assert cli.main(bad) == 2
    assert "is from another run: its model has dim=32, this run's is 16" in capsys.readouterr().err
