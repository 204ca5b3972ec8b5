"""``shardkit bench --chip``: one device's training throughput, ``vit_ref`` beside the sharded
ViT, per batch size and recomputation policy, with MFU against the chip's peak and memory.

For each (model, batch, remat policy) at one layer loop (``layers``: scan or unrolled): the
jitted train step (params and optimizer state donated, AdamW) is compiled ahead of time, its
per-device memory read from ``memory_analysis`` (argument, output, temp; peak = argument +
output + temp − aliased), then run ``warmup`` times and timed over ``steps`` calls, each to
completion, and over ``steps`` more dispatched back to back (one wait at the end, as a
training loop runs: ``back_to_back_images_per_s``); the row reports the median waited-for
step, images per second and MFU = ``bench.model_flops`` per step / median step / the
chip's peak (``PEAK_FLOPS`` by ``device_kind``; on a backend with no entry, the matmul peak
measured in the same run, as ``bench`` does). A step that does not fit is a row with its
error, not a crash. The sharded ViT runs on ``Plan({"data": 1})``: one ``shard_map`` over one
device, so the gap between the two is the cost of the toolkit itself. With ``micro_batch`` N,
a batch larger than N runs as batch/N micro-batches of N, their gradients summed before the
one update (gradient accumulation: ``Plan.microbatches``, ``vit_ref.make_train_step``'s).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import vit_ref
from shardkit import kernels
from shardkit.mesh import Plan
from shardkit.models.vit import ShardedViT
from shardkit.run.bench import matmul_peak, model_flops

# Peak dense bfloat16 FLOP/s per chip (vendor figures), by ``jax.devices()[0].device_kind``.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5": 459e12,  # v5p
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,  # v6e
}
MODELS = ("vit_ref", "shardkit")


@dataclasses.dataclass
class Row:
    """One (model, batch, remat) measurement; ``error`` is set where it did not compile or run."""

    model: str
    batch: int
    remat: str
    layers: str = "scan"
    kernel: str = "jnp"  # the sharded ViT's attention kernel (resolved; vit_ref: its own core)
    microbatches: int = 1  # gradient accumulation: the batch as this many micro-batches
    step_s: float | None = None
    images_per_s: float | None = None
    back_to_back_images_per_s: float | None = None
    mfu: float | None = None
    temp_bytes: int | None = None
    peak_bytes: int | None = None
    compile_s: float | None = None
    error: str | None = None


def chip_peak() -> tuple[str, float, str]:
    """(device kind, peak FLOP/s, where the figure comes from)."""
    kind = jax.devices()[0].device_kind
    if kind in PEAK_FLOPS:
        return kind, PEAK_FLOPS[kind], "vendor bf16 peak"
    return kind, matmul_peak(), "float32 matmul measured in this run"


def _inputs(cfg: vit_ref.ViTConfig, batch: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    images = rng.normal(size=(batch, cfg.image, cfg.image, cfg.channels)).astype(np.float32)
    return jnp.asarray(images), jnp.asarray(rng.integers(0, cfg.classes, batch), jnp.int32)


def micro_batches(batch: int, micro_batch: int | None) -> int:
    """How many micro-batches of ``micro_batch`` run ``batch`` (1 when it is not larger).

    Raises:
      ValueError: ``batch`` is larger than ``micro_batch`` and not a multiple of it.
    """
    if micro_batch is None or batch <= micro_batch:
        return 1
    if batch % micro_batch:
        raise ValueError(f"batch {batch} is not a multiple of --micro-batch {micro_batch}.")
    return batch // micro_batch


def _step_and_args(
    who: str, cfg: vit_ref.ViTConfig, batch: int, remat: str, layers: str, kernel: str = "auto",
    micro: int = 1,
) -> tuple[Any, tuple[Any, ...]]:  # fmt: skip
    """(jitted step, its arguments on the device) for ``who`` in ``MODELS``."""
    params = vit_ref.init(jax.random.key(0), cfg)
    optimizer = vit_ref.make_optimizer()
    images, labels = _inputs(cfg, batch)
    if who == "vit_ref":
        params = vit_ref.as_layers(params, layers)
        state = jax.jit(optimizer.init)(params)
        step = vit_ref.make_train_step(cfg, optimizer, remat, layers, microbatches=micro)
        return step, (params, state, images, labels)
    plan = Plan({"data": 1}, remat=remat, layers=layers, kernel=kernel, microbatches=micro)
    model = ShardedViT(cfg, plan)
    placed = model.shard(params)
    state = model.init_opt_state(optimizer, placed)
    return model.train_step(optimizer), (placed, state, *model.shard_batch(images, labels))


class Timing(NamedTuple):
    """What ``time_step`` measured: compile seconds, temp and peak bytes, the step times when
    each step is waited for, and the mean step when ``steps`` are dispatched back to back
    (the host enqueues the next step while the chip runs this one, as a training loop does)."""

    compile_s: float
    temp_bytes: int
    peak_bytes: int
    times: list[float]
    pipelined_s: float


def time_step(step: Any, args: tuple[Any, ...], steps: int, warmup: int) -> Timing:
    """Times a jitted, donating ``step(params, state, *data) -> (params, state, metrics)``
    compiled ahead of time: ``warmup`` steps, ``steps`` each waited for, then ``steps``
    dispatched back to back with one wait at the end."""
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)  # fmt: skip
    params, state, *data = args
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        params, state, metrics = compiled(params, state, *data)
        jax.block_until_ready(metrics)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(steps):
        params, state, metrics = compiled(params, state, *data)
    jax.block_until_ready(metrics)
    pipelined_s = (time.perf_counter() - t0) / steps
    return Timing(compile_s, mem.temp_size_in_bytes, peak, times, pipelined_s)


def measure(
    who: str,
    cfg: vit_ref.ViTConfig,
    batch: int,
    remat: str,
    layers: str,
    steps: int,
    warmup: int,
    peak: float,
    kernel: str = "auto",
    micro: int = 1,
) -> Row:
    """One row: compile, memory, timed steps (the module docstring says how)."""
    used = kernels.resolve_kernel(kernel, cfg.num_tokens) if who == "shardkit" else "jnp"
    row = Row(who, batch, remat, layers, used, microbatches=micro)
    try:
        step, args = _step_and_args(who, cfg, batch, remat, layers, kernel, micro)
        timing = time_step(step, args, steps, warmup)
    except (jax.errors.JaxRuntimeError, RuntimeError, MemoryError) as err:  # e.g. out of memory
        row.error = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        return row
    row.compile_s, row.temp_bytes, row.peak_bytes = (
        timing.compile_s,
        timing.temp_bytes,
        timing.peak_bytes,
    )
    row.step_s = statistics.median(timing.times)
    row.images_per_s = batch / row.step_s
    row.back_to_back_images_per_s = batch / timing.pipelined_s
    row.mfu = model_flops(cfg, batch) / row.step_s / peak
    return row


def run(
    cfg: vit_ref.ViTConfig,
    batches: Sequence[int],
    remats: Sequence[str],
    models: Sequence[str] = MODELS,
    steps: int = 10,
    warmup: int = 2,
    progress: Callable[[str], None] = lambda _: None,
    layers: str = "scan",
    kernel: str = "auto",
    micro_batch: int | None = None,
) -> dict[str, Any]:
    """Every (batch, remat, model) row at ``layers`` (the sharded ViT's attention on
    ``kernel``; batches over ``micro_batch`` accumulated); ``{"rows": [...], ...}`` (``bench
    --chip --json``)."""
    micros = {batch: micro_batches(batch, micro_batch) for batch in batches}  # checked first
    kind, peak, source = chip_peak()
    rows = []
    for batch in batches:
        for remat in remats:
            for who in models:
                progress(f"{who} batch {batch} remat={remat} layers={layers} "
                         f"micro-batches={micros[batch]}")  # fmt: skip
                rows.append(measure(who, cfg, batch, remat, layers, steps, warmup, peak, kernel,
                                    micros[batch]))  # fmt: skip
    return {
        "model": dataclasses.asdict(cfg),
        "device_kind": kind,
        "peak_flops_per_s": peak,
        "peak_source": source,
        "steps": steps,
        "warmup": warmup,
        "rows": [dataclasses.asdict(r) for r in rows],
    }


def format_table(result: dict[str, Any]) -> str:
    """The rows as a table: img/s (waited for, back to back), MFU, step ms, temp and peak GB,
    compile s."""
    head = f"{'model':<18}{'batch':>6}{'micro':>6} {'remat':<6}{'layers':<9}{'img/s':>9}"
    head += f"{'b2b img/s':>10}"
    head += f"{'MFU':>8}{'ms':>9}{'temp GB':>9}{'peak GB':>9}{'compile s':>11}"
    lines = [f"{result['device_kind']}: peak {result['peak_flops_per_s'] / 1e12:.0f} TFLOP/s "
             f"({result['peak_source']})", head]  # fmt: skip
    for r in result["rows"]:
        name = r["model"] + (f" ({r['kernel']})" if r["model"] == "shardkit" else "")
        micro = f"{r['batch'] // r.get('microbatches', 1)}×{r.get('microbatches', 1)}"
        start = f"{name:<18}{r['batch']:>6}{micro:>6} {r['remat']:<6}{r['layers']:<9}"
        if r["error"]:
            lines.append(start + f"  failed: {r['error']}")
            continue
        lines.append(
            start + f"{r['images_per_s']:>9.1f}{r['back_to_back_images_per_s']:>10.1f}"
            f"{r['mfu']:>8.1%}{r['step_s'] * 1e3:>9.2f}"
            f"{r['temp_bytes'] / 1e9:>9.2f}{r['peak_bytes'] / 1e9:>9.2f}{r['compile_s']:>11.1f}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Images per second and temp memory against batch, one line per (model, remat, layers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    series: dict[str, list[dict[str, Any]]] = {}
    for r in result["rows"]:
        label = f"{r['model']}, remat={r['remat']}"
        label += (
            f", micro-batch {r['batch'] // r['microbatches']}"
            if r.get("microbatches", 1) > 1
            else ""
        )
        label += f", {r['layers']}" if "layers" in r else ""
        series.setdefault(label, []).append(r)
    for label, rows in series.items():
        ok = [r for r in rows if not r["error"]]
        ax_speed.plot([r["batch"] for r in ok], [r["images_per_s"] for r in ok], "o-", label=label)
        ax_mem.plot([r["batch"] for r in ok], [r["temp_bytes"] / 1e9 for r in ok], "o-",
                    label=label)  # fmt: skip
    ax_speed.set(xlabel="batch", ylabel="images / s", xscale="log", title="throughput")
    ax_mem.set(xlabel="batch", ylabel="temp GB", xscale="log", title="temp memory per device")
    for ax in (ax_speed, ax_mem):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['device_kind']}: one device's train step")
    fig.savefig(path, dpi=90)
    plt.close(fig)
