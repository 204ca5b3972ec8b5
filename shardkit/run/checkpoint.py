"""Checkpoints of a training run: sharded, atomic, verified, restorable onto any plan.

``RUN/checkpoints/<step>/`` holds one checkpoint (orbax-checkpoint):

  state/            params and optimizer state (``StandardSave``): every process writes only
                    the shards its devices hold; nothing is gathered on one host
  meta/             JSON: the step, the data loader's position and the seed that, with the step,
                    fixes every random choice left (params init, data order), the model config,
                    the plan and the training options
  shardkit.sha256   written last, by process 0: the SHA-256 and size of every other file

Atomic: orbax writes into a temporary directory and renames it when complete; the manifest goes
after (itself written to a temporary name and renamed). A step without a manifest never
finished, so a crash at any point leaves the previous checkpoint as the newest valid one.

Restore (``restore``): the newest step whose files match its manifest; a missing, truncated or
altered file makes that step skipped, and named on stderr, in favour of the one before. The
arrays come back with the shardings of the abstract tree given — a new plan's, a new mesh's,
another process count's — each leaf bitwise what was saved. A checkpoint of another model
config is an error, not a fallback.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
from typing import Any

import jax

MANIFEST = "shardkit.sha256"


class CheckpointError(ValueError):
    """No usable checkpoint, or one that does not fit this run: one sentence says which."""


def _orbax() -> Any:
    import orbax.checkpoint as ocp

    return ocp


def _files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def _digest(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(step_dir: pathlib.Path) -> None:
    """The SHA-256 and size of every file under ``step_dir``, written atomically."""
    entries = {
        str(p.relative_to(step_dir)): {"sha256": _digest(p), "bytes": p.stat().st_size}
        for p in _files(step_dir)
    }
    tmp = step_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, step_dir / MANIFEST)


def damage(step_dir: pathlib.Path) -> str | None:
    """Why ``step_dir`` cannot be trusted (a sentence fragment), or None when every file is
    exactly as written."""
    manifest = step_dir / MANIFEST
    if not manifest.is_file():
        return "is incomplete (no manifest: its save never finished)"
    try:
        entries = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return f"has an unreadable {MANIFEST}"
    for name, entry in entries.items():
        path = step_dir / name
        if not path.is_file():
            return f"is missing {name}"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"is truncated ({name}: {size} bytes, {entry['bytes']} written)"
        if _digest(path) != entry["sha256"]:
            return f"is corrupted ({name} differs from what was written)"
    return None


def steps_in(directory: pathlib.Path) -> list[int]:
    """The steps with a directory under ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


class Checkpointer:
    """Saves every ``every`` steps (and whenever ``save`` is called with ``force``), keeping the
    newest ``keep``. Call ``save`` on every process: it is a collective."""

    def __init__(self, directory: pathlib.Path, every: int, keep: int) -> None:
        if every < 1 or keep < 1:
            raise ValueError(f"--checkpoint-every ({every}) and --keep ({keep}) must be positive.")
        ocp = _orbax()
        self.directory, self.every = directory.absolute(), every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        ocp = _orbax()
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.manager.save(step, args=args, force=True)
        self.manager.wait_until_finished()
        if jax.process_index() == 0:
            write_manifest(self.directory / str(step))
        _barrier(f"shardkit-checkpoint-{step}")

    def close(self) -> None:
        self.manager.close()


def _barrier(name: str) -> None:
    """Every process waits here for every other (a no-op in one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def newest_valid(directory: pathlib.Path) -> int:
    """The newest step under ``directory`` whose files verify; the skipped ones are named on
    stderr. CheckpointError when there is none."""
    if not directory.exists():
        raise CheckpointError(f"No checkpoint directory {directory}.")
    steps = steps_in(directory)
    if not steps:
        raise CheckpointError(f"{directory} holds no checkpoints (expected <step>/ folders).")
    for step in reversed(steps):
        why = damage(directory / str(step))
        if why is None:
            return step
        note(f"checkpoint {directory / str(step)} {why}; skipped.")
    raise CheckpointError(f"No readable checkpoint in {directory}: all {len(steps)} are damaged.")


def note(message: str) -> None:
    """``message`` on stderr, from process 0 only."""
    if jax.process_index() == 0:
        print(f"shardkit: {message}", file=sys.stderr, flush=True)


def set_aside_after(directory: pathlib.Path, step: int) -> None:
    """Renames the steps after ``step`` (damaged or superseded ones) to ``<step>.set-aside``:
    a resumed run saves those steps again, and nothing is deleted."""
    for later in (s for s in steps_in(directory) if s > step):
        target = directory / f"{later}.set-aside"
        n = 1
        while target.exists():
            target, n = directory / f"{later}.set-aside-{n}", n + 1
        os.replace(directory / str(later), target)


def read_meta(directory: pathlib.Path, step: int) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((directory / str(step) / "meta" / "metadata").read_text())
    return meta


def restore(directory: pathlib.Path, step: int, abstract_state: Any) -> Any:
    """The state saved at ``step``, each leaf placed with ``abstract_state``'s sharding."""
    ocp = _orbax()
    manager = ocp.CheckpointManager(directory.absolute())
    try:
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        return manager.restore(step, args=args).state
    finally:
        manager.close()


def abstract_like(tree: Any) -> Any:
    """Shapes, dtypes and shardings of ``tree``'s arrays: a restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def check_fits(meta: dict[str, Any], expected: dict[str, Any], where: pathlib.Path) -> None:
    """CheckpointError naming the first field of ``expected`` (model config, options) that the
    checkpoint's ``meta`` holds differently."""
    for section, fields in expected.items():
        saved = meta.get(section, {})
        for name, value in fields.items():
            if saved.get(name) != value:
                raise CheckpointError(
                    f"Checkpoint {where} is from another run: its {section} has {name}="
                    f"{saved.get(name)!r}, this run's is {value!r}."
                )
