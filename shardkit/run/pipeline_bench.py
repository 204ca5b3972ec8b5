"""``shardkit bench --schedules``: every pipeline schedule on one plan, timed side by side.

For a plan with a ``stage`` axis (the ViT, or ``--model gpt``), each schedule of
``schedules.SCHEDULES`` takes the same AdamW train step on the same params and batch, in one
process: GPipe, 1F1B, interleaved (V = 2, where the layers split into 2·S chunks and S
divides M) and ZB-H1 (where M ≥ S). Rounds are interleaved (machine noise hits every
schedule alike); each step is timed to completion. Per row:

  form             how the engine runs it (``Schedule.form``): GPipe in the branch form, the
                   schedules that mix F and B phased, any with a ring inside a chunk uniform
  ticks, bubble    from that form's table (``Schedule.ticks``, ``Schedule.bubble``: idle over
                   all slots, in ticks of one F, B or W; a phased or uniform super tick is
                   one tick per phase)
  ms               median and min step time
  matmul GFLOP     the busiest stage's, read from the compiled step (``Ledger.flops`` with
                   each branch counted by that stage's ticks: ``staged.stage_ledger``)
  MB sent, temp    bytes one device sends (the busiest stage) and ``memory_analysis`` temp
  / GPipe          the step time over GPipe's

On XLA:CPU the devices of a mesh share the host's cores, so a bubble costs no time here
(an idle stage frees a core for a busy one); the time column shows what each schedule's
program costs, the bubble column what it would idle on devices of their own.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import vit_ref
from shardkit.mesh import Plan, PlanError, format_mesh
from shardkit.models import gpt, staged
from shardkit.models.vit import check_plan
from shardkit.models.vit.plan import schedule
from shardkit.parallel.pipeline.schedules import Schedule
from shardkit.run import bench, lm, lm_bench
from shardkit.run.verify import make_batch

Build = Callable[[str], tuple[bench.Contender, Schedule]]  # schedule name -> its compiled step


def variants(stages: int, micro: int, depth: int) -> list[tuple[str, int]]:
    """(schedule, V) per schedule this plan can run: interleaved with V = 2 where the layers
    split into 2·S chunks and S divides M; ZB-H1 where M ≥ S; ZBV (V = 2) where both the
    layers split into 2·S chunks and M ≥ S."""
    out = [("gpipe", 1), ("1f1b", 1)]
    halves = depth % (2 * stages) == 0
    if halves and micro % stages == 0:
        out.append(("interleaved", 2))
    if micro >= stages:
        out.append(("zb", 1))
    if halves and micro >= stages:
        out.append(("zbv", 2))
    return out


def vit_builder(cfg: vit_ref.ViTConfig, plan: Plan, batch: int) -> tuple[Build, list[Any]]:
    """(build, variants) for the ViT on ``plan`` with each schedule in turn (checked first)."""
    stages, micro = plan.size("stage"), plan.microbatches
    chosen = variants(stages, micro, cfg.depth)
    plans = {name: dataclasses.replace(plan, pp=name, virtual=v) for name, v in chosen}
    for p in plans.values():
        check_plan(cfg, p, batch)
    params = vit_ref.init(jax.random.key(0), dataclasses.replace(cfg, head_zeroinit=False))
    data = tuple(np.asarray(a) for a in make_batch(cfg, batch))

    def build(name: str) -> tuple[bench.Contender, Schedule]:
        return bench.shardkit_contender(cfg, plans[name], params, data), schedule(cfg, plans[name])

    return build, chosen


def gpt_builder(cfg: gpt.GPTConfig, plan: gpt.GPTPlan, batch: int) -> tuple[Build, list[Any]]:
    """(build, variants) for the GPT on ``plan`` with each schedule in turn (checked first)."""
    chosen = variants(plan.mesh["stage"], plan.microbatches, cfg.layers)
    plans = {name: dataclasses.replace(plan, pp=name, virtual=v) for name, v in chosen}
    for p in plans.values():
        gpt.check_plan(cfg, p, batch)
    params = jax.tree.map(np.asarray, gpt.init(0, cfg))  # host copies: each step donates its own
    data = lm.sample(cfg, batch)

    def build(name: str) -> tuple[bench.Contender, Schedule]:
        contender, _ = lm_bench.hand_contender(cfg, plans[name], batch, params, data)
        return contender, plans[name].schedule()

    return build, chosen


def run(
    build: Build,
    chosen: list[tuple[str, int]],
    title: str,
    steps: int = 5,
    warmup: int = 2,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Compiles every schedule, times them in interleaved rounds; ``{"rows": [...], ...}``
    (``shardkit bench --schedules --json``)."""
    built = []
    for name, virtual in chosen:
        progress(f"compiling {name}" + (f" V={virtual}" if virtual > 1 else ""))
        built.append(build(name))
    for round_ in range(warmup + steps):
        for contender, _ in built:
            seconds = contender.run()
            if round_ >= warmup:
                contender.times.append(seconds)
    rows = [_row(c, s) for c, s in built]
    gpipe = rows[0]["step_s"]
    for row in rows:
        row["vs_gpipe"] = row["step_s"] / gpipe
    return {"title": title, "steps": steps, "warmup": warmup, "rows": rows}


def _row(c: bench.Contender, sched: Schedule) -> dict[str, Any]:
    assert c.ledger is not None
    per_stage = [staged.stage_ledger(c.ledger, sched, s) for s in range(sched.stages)]
    mem = c.ledger.memory
    return {
        "schedule": sched.name,
        "form": sched.form,
        "stages": sched.stages,
        "microbatches": sched.micro,
        "virtual": sched.virtual,
        "ticks": sched.ticks,
        "bubble": sched.bubble(),
        "step_s": statistics.median(c.times),
        "step_min_s": min(c.times),
        "step_max_s": max(c.times),
        "flops": max(led.flops for led in per_stage),
        "stage_flops": [led.flops for led in per_stage],
        "bytes_sent": max(led.total_bytes_sent() for led in per_stage),
        "temp_bytes": mem.temp if mem else None,
        "compile_s": c.compile_s,
    }


COLUMNS = [  # header, key, format
    ("schedule", "schedule", "{}"),
    ("form", "form", "{}"),
    ("M", "microbatches", "{}"),
    ("V", "virtual", "{}"),
    ("ticks", "ticks", "{}"),
    ("bubble", "bubble", "{:.3f}"),
    ("ms", "step_s", "ms"),
    ("min ms", "step_min_s", "ms"),
    ("/GPipe", "vs_gpipe", "{:.2f}"),
    ("matmul GFLOP", "flops", "GFLOP"),
    ("MB sent", "bytes_sent", "MB"),
    ("temp MiB", "temp_bytes", "MiB"),
]


def format_table(result: dict[str, Any], markdown: bool = False) -> str:
    """The rows as a table (Markdown with ``markdown``), under the run's title."""
    body = [[bench.cell(row[key], fmt) for _, key, fmt in COLUMNS] for row in result["rows"]]
    lines = bench.table_lines([h for h, _, _ in COLUMNS], body, markdown)
    return "\n".join([result["title"], *lines])


def title(model: str, mesh: dict[str, int], batch: int) -> str:
    """The table's title: the model, the mesh every schedule runs on, the batch."""
    return f"{model}: every schedule on {format_mesh(mesh)}, global batch {batch}"


def check_stages(stages: int) -> None:
    """PlanError (one sentence) unless the mesh has a stage axis to pipeline over."""
    if stages < 2:
        raise PlanError("--schedules needs a stage axis of size > 1 in --mesh.")
