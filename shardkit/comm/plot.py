"""Pictures of a strategy's communication: who exchanges what with whom, and how much.

``plot_report(report, path)`` draws one figure from a ``shardkit.report.Report``:

* a device × device matrix of the bytes each device sends to each other device in one train
  step (ring model: an all-reduce, all-gather or reduce-scatter sends to the next device of
  its group; an all-to-all sends 1/(n−1) of its bytes to every peer; a collective-permute
  follows its measured source → target pairs);
* bars of bytes sent per device per step for each (collective, axes), measured beside
  expected (the model's cost model);
* the bytes on every link that carries any, each direction its own bar (``link_bytes``): a
  one-way ring loads i → i+1 and leaves i+1 → i idle, a bidirectional one loads both halves
  alike;
* one panel per (collective, axes) present: the devices of one group on a circle, labelled
  with their mesh coordinates, and the arrows of ONE step of the collective (a ring step, the
  all-to-all exchange, or the permute's measured pairs).

matplotlib is an optional dependency (``pip install shardkit[plot]``); it is imported only
when a plot is drawn, with the non-interactive Agg backend.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import numpy as np

from shardkit.comm.ledger import Collective, Ledger
from shardkit.comm.report import Report

MEASURED, EXPECTED = "#3b6ea8", "#c9a227"
PANELS = 6  # pattern panels at most (one per (kind, axes), largest bytes first)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("shardkit.plot needs matplotlib: pip install 'shardkit[plot]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def traffic_matrix(report: Report | Ledger, devices: int | None = None) -> np.ndarray:
    """[devices, devices] bytes device i sends to device j per step (ring model, see module);
    of a ``Report`` (its plan's devices) or of any ``Ledger`` (``devices`` given)."""
    ledger = report if isinstance(report, Ledger) else report.ledger
    n = devices if isinstance(report, Ledger) else _devices(report)
    if n is None:
        raise ValueError("traffic_matrix of a Ledger needs devices=<the mesh's device count>.")
    out = np.zeros((n, n))
    for c in ledger.collectives:
        for src, dst, nbytes in _sends(c):
            out[src, dst] += nbytes * c.count
    return out


def link_bytes(
    report: Report | Ledger, devices: int | None = None
) -> list[tuple[int, int, float, float]]:
    """(i, j, bytes i → j, bytes j → i) per step for every device pair i < j that exchanges
    any: ``traffic_matrix`` read link by link, each direction separately."""
    m = traffic_matrix(report, devices)
    n = m.shape[0]
    return [(i, j, m[i, j], m[j, i]) for i in range(n) for j in range(i + 1, n)
            if m[i, j] or m[j, i]]  # fmt: skip


def _sends(c: Collective) -> list[tuple[int, int, float]]:
    """(source, target, bytes) of one execution of ``c``."""
    if c.kind == "collective-permute":
        return [(s, t, c.result_bytes) for s, t in c.source_target_pairs]
    out = []
    for group in c.replica_groups:
        n = len(group)
        if n < 2:
            continue
        if c.kind == "all-to-all":
            out += [(s, t, c.bytes_sent / (n - 1)) for s in group for t in group if s != t]
        else:  # ring: each device sends its share to the next device of the group
            out += [(group[i], group[(i + 1) % n], c.bytes_sent) for i in range(n)]
    return out


def plot_report(report: Report, path: str | pathlib.Path) -> pathlib.Path:
    """Draws ``report``'s communication pattern and byte bars into ``path`` (PNG by suffix).

    Returns the path written. Raises ImportError (with the install hint) without matplotlib.
    """
    plt = _pyplot()
    patterns = _pattern_examples(report)
    counts = {key: t.count for key, t in report.ledger.summary().items()}
    cols = 3
    rows = 2 + math.ceil(len(patterns) / cols)
    fig = plt.figure(figsize=(5.2 * cols, 4.6 * rows), layout="constrained")
    grid = fig.add_gridspec(rows, cols)
    _draw_matrix(fig.add_subplot(grid[0, 0]), report, fig)
    _draw_bars(fig.add_subplot(grid[0, 1:]), report)
    _draw_links(fig.add_subplot(grid[1, :]), report)
    for i, c in enumerate(patterns):
        _draw_pattern(fig.add_subplot(grid[2 + i // cols, i % cols]), c, report, counts)
    fig.suptitle(_title(report), fontsize=11)
    path = pathlib.Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _devices(report: Report) -> int | None:
    """The devices of the report's mesh (None when its expectation does not say)."""
    sizes = report.expectation.axis_sizes
    return math.prod(sizes.values()) if sizes else None


def _title(report: Report) -> str:
    facts = report.expectation.describe()
    sizes = report.expectation.axis_sizes
    mesh = ", ".join(f"{a}={s}" for a, s in sizes.items() if s > 1) or "1 device"
    options = "".join(f" {k}={facts[k]}" for k in ("sp", "zero", "remat") if k in facts)
    verdict = "contract holds" if report.contract_ok else "contract BROKEN"
    return (
        f"{mesh} {options}: {report.measured_bytes_sent / 1e6:.3f}"
        f" MB sent per device per step, {report.ratio:.3f}× the expected minimum ({verdict})"
    )


def _pattern_examples(report: Report) -> list[Collective]:
    """The largest collective of each (kind, axes), biggest total bytes first."""
    best: dict[tuple[str, tuple[str, ...]], Collective] = {}
    for c in report.ledger.collectives:
        key = (c.kind, c.axes)
        if key not in best or c.total_bytes_sent > best[key].total_bytes_sent:
            best[key] = c
    ranked = sorted(
        best.values(), key=lambda c: -report.ledger.summary()[(c.kind, c.axes)].bytes_sent
    )
    return ranked[:PANELS]


def _draw_matrix(ax: Any, report: Report, fig: Any) -> None:
    matrix = traffic_matrix(report) / 1e6
    image = ax.imshow(matrix, cmap="Blues")
    n = matrix.shape[0]
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xlabel("to device")
    ax.set_ylabel("from device")
    ax.set_title("MB sent per step, device → device")
    fig.colorbar(image, ax=ax, shrink=0.8)


def _draw_bars(ax: Any, report: Report) -> None:
    rows = report.rows
    labels = [f"{r.kind}\n{','.join(r.axes) or '-'}" for r in rows]
    y = np.arange(len(rows))
    got = [r.bytes_sent / 1e6 for r in rows]
    want = [r.expected_bytes_sent / 1e6 for r in rows]
    ax.barh(y - 0.2, got, 0.4, color=MEASURED, label="measured (compiled HLO)")
    ax.barh(y + 0.2, want, 0.4, color=EXPECTED, label="expected (the cost model)")
    for i, r in enumerate(rows):
        mark = "✓" if r.ok else "✗"
        ax.annotate(
            f" {r.count}× / {r.expected_count}× {mark}",
            (max(got[i], want[i]), i),
            va="center",
            fontsize=8,
        )
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("MB sent per device per step")
    ax.set_title("bytes per collective: measured vs expected (ops per step)")
    ax.legend(loc="best", fontsize=8)
    ax.margins(x=0.25)


def _draw_links(ax: Any, report: Report) -> None:
    links = link_bytes(report)
    x = np.arange(len(links))
    up = [f / 1e6 for _, _, f, _ in links]
    down = [b / 1e6 for _, _, _, b in links]
    ax.bar(x - 0.2, up, 0.4, color=MEASURED, label="i → j (lower to higher device)")
    ax.bar(x + 0.2, down, 0.4, color="#9bb7d4", label="j → i")
    ax.set_xticks(x, [f"{i}↔{j}" for i, j, _, _ in links], fontsize=7, rotation=90)
    ax.set_ylabel("MB per step")
    ax.set_ylim(0, 1.3 * max([*up, *down, 1e-9]))  # room for the legend above the bars
    ax.set_title("bytes on each link, each direction (permutes: measured pairs; all-reduce, "
                 "all-gather, reduce-scatter: ring order of their groups)", fontsize=9)  # fmt: skip
    ax.legend(loc="best", fontsize=8)


_SHORT = {"data": "d", "seq": "s", "model": "m", "seq_ring": "sr", "seq_ulysses": "su"}


def _coords(report: Report, device: int) -> str:
    """``device``'s mesh coordinates, e.g. 'd1 s0 m1' (axes of size 1 left out)."""
    sizes = report.expectation.axis_sizes
    index = np.unravel_index(device, list(sizes.values()))
    return " ".join(
        f"{_SHORT.get(a, a)}{i}" for (a, n), i in zip(sizes.items(), index, strict=True) if n > 1
    )


def _draw_pattern(ax: Any, c: Collective, report: Report, counts: dict[Any, int]) -> None:
    """One group of ``c`` on a circle and the arrows of one step of the collective."""
    devices, arrows, step = _one_step(c)
    n = len(devices)
    angle = {d: 2 * math.pi * i / n + math.pi / 2 for i, d in enumerate(devices)}
    pos = {d: (math.cos(a), math.sin(a)) for d, a in angle.items()}
    for src, dst in arrows:
        ax.annotate(
            "",
            xy=pos[dst],
            xytext=pos[src],
            arrowprops={
                "arrowstyle": "-|>",
                "color": MEASURED,
                "lw": 1.2,
                "shrinkA": 14,
                "shrinkB": 14,
                "connectionstyle": "arc3,rad=0.12",
            },
        )
    for d, (x, y) in pos.items():
        ax.scatter([x], [y], s=500, color="white", edgecolors="black", zorder=3)
        ax.text(x, y, str(d), ha="center", va="center", zorder=4, fontsize=9)
        side = "left" if x > 0.3 else "right" if x < -0.3 else "center"
        ax.text(1.18 * x, 1.25 * y, _coords(report, d), ha=side, va="center", fontsize=7)
    axes = ",".join(c.axes) or "-"
    ops = counts[(c.kind, c.axes)]
    ax.set_title(f"{c.kind} over {axes}: groups of {c.group_size}, {ops} ops per step", fontsize=9)
    shapes = ", ".join("×".join(map(str, s)) or "scalar" for s in c.shapes[:2])
    ax.text(
        0,
        -1.75,
        f"{step}\n{shapes} {c.dtypes[0]}: {c.bytes_sent:,.0f} B per device",
        ha="center",
        fontsize=8,
    )
    ax.set_xlim(-1.7, 1.7)
    ax.set_ylim(-2.1, 1.6)
    ax.set_aspect("equal")
    ax.axis("off")


def _one_step(c: Collective) -> tuple[list[int], list[tuple[int, int]], str]:
    """(devices of one group, arrows of one step, a caption) for ``c``."""
    if c.kind == "collective-permute":
        linked = _component(c.source_target_pairs, c.source_target_pairs[0][0])
        arrows = [(s, t) for s, t in c.source_target_pairs if s in linked]
        return sorted(linked), arrows, "each device sends its whole block to its target"
    group = list(c.replica_groups[0])
    n = len(group)
    if c.kind == "all-to-all":
        arrows = [(s, t) for s in group for t in group if s != t]
        return group, arrows, "each device sends 1/n of its block to every peer, at once"
    arrows = [(group[i], group[(i + 1) % n]) for i in range(n)]
    steps = {"all-reduce": f"2·(n−1) = {2 * (n - 1)}", "all-gather": f"n−1 = {n - 1}"}
    caption = f"one ring step (of {steps.get(c.kind, f'n−1 = {n - 1}')}): 1/n of the data moves"
    return group, arrows, caption


def _component(pairs: tuple[tuple[int, int], ...], start: int) -> set[int]:
    """The devices linked to ``start`` by source → target pairs (either direction)."""
    seen, todo = {start}, [start]
    while todo:
        d = todo.pop()
        for s, t in pairs:
            for a, b in ((s, t), (t, s)):
                if a == d and b not in seen:
                    seen.add(b)
                    todo.append(b)
    return seen
