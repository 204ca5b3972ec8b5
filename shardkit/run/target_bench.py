"""``shardkit bench --target TOPOLOGY``: bench's strategies compiled for a TPU slice, never run.

For each strategy, shardkit's train step and XLA auto's (``bench.auto_train_step``: the
reference step under ``jax.jit`` with the plan's shardings) are compiled for the slice by the
TPU compiler on this machine (``run.target``: libtpu's topology, no chip). The row sets their
compile-only columns side by side: the bytes each chip sends, the share of them a matmul
hides, per-chip memory against HBM, shardkit's contract on that compiler, and the planner's
estimated step time (``run.planner``: the compiled matmul FLOPs at the chip's measured
throughput, plus the exposed bytes over one ICI ring). It times nothing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import vit_ref
from shardkit.mesh import format_mesh
from shardkit.run import bench, config, planner
from shardkit.run import target as tgt
from shardkit.run.verify import Case


def auto_facts(
    cfg: vit_ref.ViTConfig, case: Case, batch: int, devices: Any, flags: str
) -> dict[str, Any]:
    """``planner.facts`` of XLA auto's step for ``case`` (no contract: auto has none)."""
    kind = str(devices.flat[0].device_kind)
    start = time.perf_counter()
    try:
        with tgt.uncached():
            options = tgt.TPU_FLAGS[flags]
            ledger = bench.measure_auto(cfg, case.plan, batch, devices, options)
    except Exception as err:  # XLA's refusal (HBM, a plan auto cannot express): one sentence
        return planner.refused(err, start)
    return planner.ledger_facts(ledger, ledger.total_bytes_sent(), kind, None, start)


def run(
    cfg: vit_ref.ViTConfig,
    cases: Sequence[Case],
    batch: int,
    topology: str,
    flags: str = "default",
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Compiles shardkit's and auto's step of every case for ``topology``; returns
    ``{"rows": [...], ...}`` (``shardkit bench --target --json``)."""
    devices = tgt.topology_devices(topology, cases[0].plan.num_devices)
    kind = str(devices.flat[0].device_kind)
    chip = planner.chip_of(kind)
    models = [config.build(cfg, case.plan, batch, devices) for case in cases]  # all checked
    rows = []
    for case, model in zip(cases, models, strict=True):
        progress(f"{case.name} ({format_mesh(case.plan.mesh)}, sp={case.plan.sp})")
        ours = planner.from_facts(cfg, case.plan, planner.facts(model, batch, flags), chip)
        auto = planner.from_facts(cfg, case.plan, auto_facts(cfg, case, batch, devices, flags),
                                  chip)  # fmt: skip
        rows.append({"strategy": case.name, "mesh": format_mesh(case.plan.mesh),
                     "shardkit": _json(ours, batch), "auto": _json(auto, batch)})  # fmt: skip
    return {"topology": topology, "device_kind": kind, "flags": flags, "batch": batch,
            "model": dataclasses.asdict(cfg),
            "chip": chip.source, "rows": rows}  # fmt: skip


def _json(e: planner.Estimate, batch: int) -> dict[str, Any]:
    sent = e.comm_s + e.hidden_s
    return e.to_json(batch) | {"hidden_fraction": e.hidden_s / sent if sent else 0.0}


COLUMNS = ("strategy", "mesh", "shardkit ms", "auto ms", "shardkit MB", "auto MB",
           "hidden", "auto hidden", "GiB", "auto GiB", "contract")  # fmt: skip


def _cells(row: dict[str, Any]) -> list[str]:
    ours, auto = row["shardkit"], row["auto"]

    def ms(e: dict[str, Any]) -> str:
        return "refused" if e["error"] else f"{e['step_s'] * 1e3:.3g}"

    def mb(e: dict[str, Any]) -> str:
        return "-" if e["error"] else f"{e['bytes_sent'] / 1e6:,.1f}"

    def hid(e: dict[str, Any]) -> str:
        return "-" if e["error"] else f"{e['hidden_fraction']:.0%}"

    def gib(e: dict[str, Any]) -> str:
        return "-" if e["peak_bytes"] is None else f"{e['peak_bytes'] / tgt.GIB:.2f}"

    contract = {True: "✓", False: "✗", None: "-"}[ours["contract_ok"]]
    return [row["strategy"], row["mesh"], ms(ours), ms(auto), mb(ours), mb(auto), hid(ours),
            hid(auto), gib(ours), gib(auto), contract]  # fmt: skip


def format_table(result: dict[str, Any], markdown: bool = False) -> str:
    """The rows as ``bench --target`` prints them, under a line naming the slice."""
    lines = [f"{result['topology']} ({result['device_kind']}, libtpu flags {result['flags']}): "
             "compiled, not run; ms estimated from the matmul FLOPs at the chip's step "
             f"throughput ({result['chip']}) plus the exposed bytes over one ICI ring",
             ""]  # fmt: skip
    body = [_cells(row) for row in result["rows"]]
    lines += bench.table_lines(COLUMNS, body, markdown)
    errors = [(r["strategy"], who, r[who]["error"]) for r in result["rows"]
              for who in ("shardkit", "auto") if r[who]["error"]]  # fmt: skip
    lines += [f"{name} ({who}): {err}" for name, who, err in errors]
    return "\n".join(lines)
