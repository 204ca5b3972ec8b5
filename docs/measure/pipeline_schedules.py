"""Draws the five pipeline schedules from their tables and writes their measured figures.

    python docs/measure/pipeline_schedules.py      # ~1 minute on 2 cores

Output: ``docs/img/pipeline_schedules.png`` (ticks × stages, coloured by action, for S=4 and
M=8; interleaved and ZBV with V=2) and ``docs/strategies/measured/pipeline.txt`` (per
schedule: ticks,
bubble from the table and its formula, peak in-flight microbatches per stage, and the engine's
stash slots and compiled temp memory per device for M = 4, 8, 16 on the test model of
``tests/parallel/test_pipeline.py``).
"""

import pathlib
import sys

import shardkit

shardkit.set_cpu_devices(8)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from shardkit.parallel import pipeline as pl  # noqa: E402
from shardkit.parallel.pipeline import schedules as sc  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(DOCS.parent / "tests" / "parallel"))
import test_pipeline as model  # noqa: E402

COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452"}
S, M = 4, 8
BUILT = [
    sc.gpipe(S, M),
    sc.one_f_one_b(S, M),
    sc.interleaved(S, M, 2),
    sc.zero_bubble(S, M),
    sc.zbv(S, M),
]


def draw(path: pathlib.Path) -> None:
    width = max(s.ticks for s in BUILT)
    fig, axes = plt.subplots(len(BUILT), 1, figsize=(0.32 * width + 1.5, 1.25 * len(BUILT) + 1))
    for ax, schedule in zip(axes, BUILT, strict=True):
        for tick, row in enumerate(schedule.grid):
            for stage, action in enumerate(row):
                if action is None:
                    continue
                shade = 1.0 - 0.45 * action.virtual
                ax.add_patch(
                    plt.Rectangle((tick, stage), 1, 1, color=COLOURS[action.kind], alpha=shade)
                )
                ax.text(tick + 0.5, stage + 0.5, str(action.micro), ha="center", va="center",
                        fontsize=7, color="white")  # fmt: skip
        ax.set_xlim(0, width)
        ax.set_ylim(S, 0)
        ax.set_yticks([s + 0.5 for s in range(S)], [f"stage {s}" for s in range(S)], fontsize=7)
        ax.set_xticks([])
        title = f"{schedule.name}  (S={S}, M={M}, V={schedule.virtual}): {schedule.ticks} ticks,"
        ax.set_title(f"{title} bubble {schedule.bubble():.3f}", fontsize=9, loc="left")
    legend = [Patch(color=c, label=k) for k, c in COLOURS.items()]
    legend.append(Patch(color=COLOURS["F"], alpha=0.55, label="second chunk (interleaved, ZBV)"))
    fig.legend(handles=legend, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)


def table() -> str:
    lines = [
        f"{'schedule':<12}{'ticks':>6}{'bubble':>8}{'formula':>9}  in flight per stage"
        f"   stash slots, temp KiB at M=4 / 8 / 16"
    ]
    for s in BUILT:
        formula = sc.bubble_formula(s.name, S, M, s.virtual)
        flight = ",".join(str(s.in_flight(i)) for i in range(S))
        memory = []
        for micro in (4, 8, 16):
            built = sc.build(s.name, S, micro, s.virtual)
            slots = pl.tables(built).stash_slots
            if s.name != "interleaved":
                kib = model.temp_bytes(s.name, S, micro) / 1024
                memory.append(f"{slots} slots {kib:.1f}")
            else:
                memory.append(f"{slots} slots")
        lines.append(
            f"{s.name:<12}{s.ticks:>6}{s.bubble():>8.3f}{formula:>9.3f}  {flight:<20}"
            f"{' / '.join(memory)}"
        )
    return "\n".join(lines)


def main() -> None:
    draw(DOCS / "img" / "pipeline_schedules.png")
    text = f"S={S}, M={M} (interleaved, zbv: V=2)\n{table()}\n"
    (DOCS / "strategies" / "measured" / "pipeline.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
