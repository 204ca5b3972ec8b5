"""``shardkit train``: the sharded ViT trained for real on any plan, with its records on disk.

One run: load and check the data (``datasets``), build ``ShardedViT(cfg, plan)``, place
``vit_ref.init``'s params on the mesh, compile the train and eval steps ahead of time (through the
persistent compilation cache), then for each step feed one shuffled global batch, take one
AdamW step (linear warmup, cosine decay, gradients clipped to a global norm that the step
computes from the sharded gradients by hand), and append one JSON record to
``DIR/metrics.jsonl``:

  every step       step, epoch, loss, lr, grad_norm, images_per_s
  every K steps    + test_loss, test_accuracy (a fraction 0–1); the last step always evaluates

``DIR/config.json`` holds the model, the plan, the options, the data, package versions and
compile seconds; ``DIR/curves.png`` draws loss and accuracy against step at the end (also after
a failure, from what was recorded). Everything but ``images_per_s`` is a function of the seed,
the plan and the data: two runs write the same values bit for bit.

A non-finite loss stops the run (``TrainingDivergedError``) with the step it happened at; the
records up to it stay readable.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import vit_ref
from shardkit.mesh import Plan, format_mesh
from shardkit.models.vit import ShardedViT
from shardkit.run import checkpoint, datasets
from shardkit.run.datasets import Dataset, Loader
from shardkit.run.launch import beat

RUN_FILES = ("metrics.jsonl", "config.json", "curves.png")
TIMING_KEYS = ("images_per_s",)  # the only record values that depend on the machine's speed


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or infinite; the message names the step."""


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """What ``shardkit train`` does besides the model and the plan (its flags, with defaults).

    Attributes:
      steps: optimizer steps; batch: global batch (split over ``data``).
      lr: peak learning rate, reached after ``warmup`` linear steps (None: 10% of ``steps``),
        then cosine decay to 0.
      clip: global gradient-norm bound (``float("inf")``: never clip, still report the norm).
      weight_decay: AdamW's decoupled weight decay.
      eval_every: evaluate on the test split every this many steps (and at the last step).
      seed: params init and data order.
    """

    steps: int = 400
    batch: int = 128
    lr: float = 3e-3
    warmup: int | None = None
    clip: float = 1.0
    weight_decay: float = 1e-4
    eval_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}."
                )
        if self.warmup is None:
            object.__setattr__(self, "warmup", self.steps // 10)
        assert self.warmup is not None
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"--warmup {self.warmup} must be in [0, --steps {self.steps}).")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}.")
        if not self.clip > 0:
            raise ValueError(f"--clip must be positive (0 means never clip), got {self.clip}.")

    def schedule(self) -> optax.Schedule:
        return optax.warmup_cosine_decay_schedule(0.0, self.lr, self.warmup or 0, self.steps)


def optimizers(
    opts: TrainOptions,
) -> tuple[optax.GradientTransformation, optax.GradientTransformation]:
    """(sharded, reference): the same AdamW and schedule; the reference clips with optax, the
    sharded step clips by hand inside its shard_map (``ShardedViT.train_step(clip_norm=...)``)."""
    sharded = vit_ref.make_optimizer(opts.schedule(), opts.weight_decay)
    reference = vit_ref.make_optimizer(opts.schedule(), opts.weight_decay, clip_norm=opts.clip)
    return sharded, reference


def enable_cache(cache_dir: str | None) -> None:
    """Persistent compilation cache in ``cache_dir`` (None: off). On CPU it stores nothing unless
    the minimum compile time is 0 (DESIGN.md); set before the first compilation."""
    if cache_dir is None:
        return
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shardkit", "jax")


def default_out_dir() -> pathlib.Path:
    return pathlib.Path("runs") / datetime.datetime.now().strftime("train-%Y%m%d-%H%M%S")


def prepare_out_dir(out: pathlib.Path, force: bool) -> None:
    """Creates ``out``; refuses (ValueError) to write into a non-empty one without ``force``,
    and with it removes only the files a run writes."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory.")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ValueError(f"--out {out} already holds files; pass --force to overwrite the run.")
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


def versions() -> dict[str, str]:
    """Python's and each package's version; "not installed (source tree)" for a package run
    from a checkout without metadata (``PYTHONPATH=.``), instead of failing the run."""
    names = ("shardkit", "jax", "jaxlib", "numpy", "optax")
    return {"python": platform.python_version()} | {n: _version(n) for n in names}


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed (source tree)"


# ----------------------------------------------------------------------------- steps


def compile_steps(
    model: ShardedViT, opts: TrainOptions, params: Any, opt_state: Any, optimizer: Any
) -> tuple[Callable[..., Any], Callable[..., Any], dict[str, float]]:
    """(train step, eval step, compile seconds), both compiled ahead of time for ``opts.batch``."""
    cfg, data = model.cfg, model.sharding(model.batch_spec)
    shape = (opts.batch, cfg.image, cfg.image, cfg.channels)
    batch = [
        jax.ShapeDtypeStruct(shape, jnp.float32, sharding=data),
        jax.ShapeDtypeStruct((opts.batch,), jnp.int32, sharding=data),
    ]
    valid = jax.ShapeDtypeStruct((opts.batch,), jnp.bool_, sharding=data)
    seconds = {}
    t0 = time.perf_counter()
    step: Any = model.train_step(optimizer, clip_norm=opts.clip)
    train = step.lower(params, opt_state, *batch).compile()
    seconds["train_step"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    evaluate = jax.jit(eval_sums(model)).lower(params, *batch, valid).compile()
    seconds["eval_step"] = time.perf_counter() - t0
    return train, evaluate, seconds


def eval_sums(model: ShardedViT) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """(params, images, labels, valid) -> (Σ cross-entropy, Σ correct) over the valid rows."""

    def sums(params: Any, images: jax.Array, labels: jax.Array, valid: jax.Array):
        logits = model.forward(params, images)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        correct = (logits.argmax(-1) == labels).astype(jnp.float32)
        return jnp.where(valid, ce, 0.0).sum(), jnp.where(valid, correct, 0.0).sum()

    return sums


def evaluate(
    eval_step: Callable[..., Any], params: Any, ds: Dataset, batch: int, model: ShardedViT
) -> dict[str, float]:
    """test_loss and test_accuracy over the whole test split (last batch padded, pads masked)."""
    n = len(ds.test_labels)
    padded = -(-n // batch) * batch
    images = np.zeros((padded, *ds.test_images.shape[1:]), np.float32)
    labels = np.zeros((padded,), np.int32)
    images[:n], labels[:n] = ds.test_images, ds.test_labels
    valid = np.arange(padded) < n
    sharding = model.sharding(model.batch_spec)
    loss = correct = 0.0
    for start in range(0, padded, batch):
        rows = slice(start, start + batch)
        arrays = datasets.place(sharding, images[rows], labels[rows], valid[rows])
        ce_sum, correct_sum = eval_step(params, *arrays)
        loss, correct = loss + float(ce_sum), correct + float(correct_sum)
    return {"test_loss": loss / n, "test_accuracy": correct / n}


# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Run:
    """One training run's files and the records written so far (``write``: False on every
    process but 0 of a multi-process run, which keep the records in memory only)."""

    out: pathlib.Path
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    write: bool = True

    def write_config(self, config: dict[str, Any]) -> None:
        if self.write:
            (self.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    def start(self, records: list[dict[str, Any]]) -> None:
        """A fresh ``metrics.jsonl`` holding ``records`` (a resumed run's past steps)."""
        self.records = list(records)
        if self.write:
            lines = "".join(json.dumps(_finite_or_none(r)) + "\n" for r in records)
            (self.out / "metrics.jsonl").write_text(lines)

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if not self.write:
            return
        with open(self.out / "metrics.jsonl", "a") as f:  # one whole line per record
            f.write(json.dumps(_finite_or_none(record)) + "\n")


def _finite_or_none(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN: non-finite floats are written as null."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }


def run_config(
    model: ShardedViT, opts: TrainOptions, ds: Dataset, loader: Loader
) -> dict[str, Any]:
    """What ``config.json`` records before the run starts (compile seconds join it later)."""
    return {
        "model": dataclasses.asdict(model.cfg),
        "plan": dataclasses.asdict(model.plan) | {"mesh": format_mesh(model.plan.mesh)},
        "options": dataclasses.asdict(opts),
        "data": ds.describe() | {"steps_per_epoch": loader.steps_per_epoch},
        "versions": versions(),
    }


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """``--checkpoint-every K`` (and at the last step), keeping the newest ``--keep N``."""

    every: int
    keep: int = 3


# The options that change what a step computes: a resumed run must have the checkpoint's.
RUN_DEFINING = ("steps", "batch", "lr", "warmup", "clip", "weight_decay", "seed")


def checkpoint_meta(step: int, model: ShardedViT, opts: TrainOptions, loader: Loader) -> dict:
    """What a checkpoint records besides the arrays: where the run is and what it is."""
    return {
        "step": step,
        "loader": {"next_batch": step, "epoch": loader.epoch(step), "seed": opts.seed},
        "rng": {"seed": opts.seed, "note": "init and data order are functions of seed and step"},
        "model": dataclasses.asdict(model.cfg),
        "options": dataclasses.asdict(opts),
        "plan": dataclasses.asdict(model.plan) | {"mesh": format_mesh(model.plan.mesh)},
    }


def resume_state(
    directory: pathlib.Path, model: ShardedViT, opts: TrainOptions, state: dict[str, Any]
) -> tuple[dict[str, Any], int, list[dict[str, Any]]]:
    """(state placed under ``model``'s plan, its step, the run's records up to that step) from
    the newest valid checkpoint of run directory ``directory``."""
    where = directory / "checkpoints"
    step = checkpoint.newest_valid(where)
    meta = checkpoint.read_meta(where, step)
    options = dataclasses.asdict(opts)
    checkpoint.check_fits(
        meta,
        {"model": dataclasses.asdict(model.cfg), "options": {k: options[k] for k in RUN_DEFINING}},
        where / str(step),
    )
    _check_layer_form(meta, model, where / str(step))
    restored = checkpoint.restore(where, step, checkpoint.abstract_like(state))
    checkpoint.note(f"resuming from step {step} of {opts.steps} ({where / str(step)}).")
    if jax.process_index() == 0:
        checkpoint.set_aside_after(where, step)  # this run writes those steps anew
    records = read_records(directory / "metrics.jsonl")
    return restored, step, [r for r in records if r["step"] <= step]


def _check_layer_form(meta: dict[str, Any], model: ShardedViT, where: pathlib.Path) -> None:
    """CheckpointError unless the checkpoint's blocks are in this plan's form: stacked, or a
    list of per-layer trees (``--layers list``); any other plan change restores."""
    saved = meta.get("plan", {}).get("layers", "scan")
    if (saved == "list") != (model.plan.layers == "list"):
        form = lambda layers: "per-layer" if layers == "list" else "stacked"  # noqa: E731
        raise checkpoint.CheckpointError(
            f"Checkpoint {where} holds {form(saved)} blocks (--layers {saved}) and this run "
            f"keeps them {form(model.plan.layers)}: resume with --layers "
            f"{'list' if saved == 'list' else 'scan or unrolled'}."
        )


def read_records(metrics: pathlib.Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (none when it is absent); a last line cut short by a
    crash mid-write is dropped, a bad line before it is an error."""
    if not metrics.is_file():
        return []
    lines = metrics.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise checkpoint.CheckpointError(
                    f"{metrics} line {number} is not a JSON record; the run's records are damaged."
                ) from None
    return records


def train(
    cfg: vit_ref.ViTConfig,
    plan: Plan,
    ds: Dataset,
    opts: TrainOptions,
    out: pathlib.Path,
    *,
    extra_config: dict[str, Any] | None = None,
    progress: bool = True,
    checkpoints: CheckpointOptions | None = None,
    resume: pathlib.Path | None = None,
) -> dict[str, Any]:
    """Trains ``cfg`` under ``plan`` on ``ds``; writes ``out``'s files; returns the last record.

    ``checkpoints``: save ``out/checkpoints/<step>`` (``shardkit.run.checkpoint``). ``resume``:
    continue the run in that directory from its newest valid checkpoint, under ``plan`` (any
    plan: the arrays are re-placed); its records up to that step start ``out``'s metrics.

    Raises:
      TrainingDivergedError: the loss became non-finite (records up to that step are on disk).
      CheckpointError: ``resume`` has no usable checkpoint of this model and these options.
    """
    model = ShardedViT(cfg, plan)
    model.check_batch(opts.batch)
    lead = jax.process_index() == 0  # the one process that writes files and shows progress
    loader = Loader(ds.train_images, ds.train_labels, opts.batch, opts.seed)
    optimizer, _ = optimizers(opts)
    state, start, records = _initial_state(model, opts, optimizer, resume)
    run = Run(out, write=lead)
    run.start(records)
    config = run_config(model, opts, ds, loader) | (extra_config or {})
    config |= {"resumed": {"from": str(resume), "step": start}} if resume is not None else {}
    run.write_config(config)
    step_fn, eval_step, config["compile_s"] = compile_steps(
        model, opts, state["params"], state["opt_state"], optimizer
    )
    run.write_config(config)
    beat()  # compiled: the watchdog's clock starts now
    saver = _checkpointer(out, checkpoints)
    bar = _progress(opts.steps, progress and lead, initial=start)
    try:
        batches = loader.batches(start, opts.steps, model.sharding(model.batch_spec))
        for step, batch in enumerate(batches, start=start + 1):
            params, opt_state, record = _train_step(step_fn, state, batch, opts, loader, step)
            state = {"params": params, "opt_state": opt_state}
            _check_finite(record, step, run)
            if step % opts.eval_every == 0 or step == opts.steps:
                record |= evaluate(eval_step, params, ds, opts.batch, model)
            run.append(record)
            if saver and (saver.due(step) or step == opts.steps):
                saver.save(step, state, checkpoint_meta(step, model, opts, loader))
            beat()
            _show(bar, run.records)
    finally:
        bar.close()
        if saver:
            saver.close()
        if lead:
            plot_curves(run.records, out / "curves.png")
    return run.records[-1]


def _initial_state(
    model: ShardedViT, opts: TrainOptions, optimizer: Any, resume: pathlib.Path | None
) -> tuple[dict[str, Any], int, list[dict[str, Any]]]:
    """(params and optimizer state, the step they are at, the records so far): fresh from the
    seed, or the newest valid checkpoint of ``resume`` placed on this model's plan."""
    params = model.shard(vit_ref.init(jax.random.key(opts.seed), model.cfg))
    state = {"params": params, "opt_state": model.init_opt_state(optimizer, params)}
    if resume is None:
        return state, 0, []
    return resume_state(resume, model, opts, state)


def _checkpointer(
    out: pathlib.Path, checkpoints: CheckpointOptions | None
) -> checkpoint.Checkpointer | None:
    """The run's checkpoint writer under ``out/checkpoints``, or None without checkpoints."""
    if checkpoints is None:
        return None
    return checkpoint.Checkpointer(out / "checkpoints", checkpoints.every, checkpoints.keep)


def _check_finite(record: dict[str, Any], step: int, run: Run) -> None:
    """Records ``record`` and raises ``TrainingDivergedError`` if its loss is not finite."""
    if not math.isfinite(record["loss"]):
        run.append(record)
        raise TrainingDivergedError(
            f"The loss became {record['loss']} at step {step}; stopped (records so far "
            f"are in {run.out / 'metrics.jsonl'})."
        )


def _train_step(
    step_fn: Callable[..., Any], state: dict[str, Any], batch: tuple[jax.Array, ...],
    opts: TrainOptions, loader: Loader, step: int,
) -> tuple[Any, Any, dict[str, Any]]:  # fmt: skip
    """One optimizer step (``step`` counts from 1) and its record."""
    t0 = time.perf_counter()
    params, opt_state, metrics = step_fn(state["params"], state["opt_state"], *batch)
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    record = {
        "step": step,
        "epoch": loader.epoch(step - 1),
        "loss": loss,
        "lr": float(opts.schedule()(step - 1)),
        "grad_norm": grad_norm,
        "images_per_s": opts.batch / (time.perf_counter() - t0),
    }
    return params, opt_state, record


def _progress(total: int, enabled: bool, initial: int = 0) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", file=sys.stderr,
                dynamic_ncols=True)  # fmt: skip


def _show(bar: Any, records: list[dict[str, Any]]) -> None:
    record = records[-1]
    shown = {"loss": f"{record['loss']:.3f}", "img/s": f"{record['images_per_s']:.0f}"}
    accuracy = next((r["test_accuracy"] for r in reversed(records) if "test_accuracy" in r), None)
    if accuracy is not None:
        shown["test_acc"] = f"{accuracy:.3f}"
    bar.set_postfix(shown, refresh=False)
    bar.update(1)


def plot_curves(records: list[dict[str, Any]], path: pathlib.Path) -> None:
    """Loss (train and test) and test accuracy against step, as one PNG."""
    if not records:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    evals = [r for r in records if "test_accuracy" in r]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax_loss.plot(steps, [r["loss"] for r in records], lw=1, label="train loss")
    ax_loss.plot(
        [r["step"] for r in evals], [r["test_loss"] for r in evals], "o-", label="test loss"
    )
    ax_loss.set(xlabel="step", ylabel="cross-entropy", yscale="log", title="loss")
    ax_loss.legend()
    ax_acc.plot([r["step"] for r in evals], [r["test_accuracy"] for r in evals], "o-", color="C2")
    ax_acc.set(xlabel="step", ylabel="test accuracy", ylim=(0, 1), title="test accuracy")
    ax_acc.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
