"""A pipeline schedule compiled into the static int32 tables the engine scans (numpy only).

``tables(schedule)`` gives, per tick and stage, the action to run (``branch_index``), its
microbatch and chunk, and the stash / inbox slot it reads or writes, with slots assigned by
interval colouring so each buffer holds only what the busiest stage keeps in flight;
``forward_tables`` does the same for the forwards alone (inference). Nothing here traces: the
tables are data, tested against the schedule grid directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from shardkit.parallel.pipeline.schedules import Schedule

IDLE = 0
KIND_INDEX = {"F": 0, "B": 1, "W": 2}
# Named scopes of the segment scans and the branches: collectives inside a branch carry both in
# their HLO op_name, so a ledger can count each by how often each stage runs it (``branch_runs``).
SEGMENT_SCOPE = "pp_segment{}"
BRANCH_SCOPE = "pp_branch{}"


def branch_index(kind: str, first: bool, last: bool) -> int:
    """The ``lax.switch`` branch of an action: idle is 0, then (kind, first chunk, last chunk)."""
    return 1 + 4 * KIND_INDEX[kind] + 2 * first + last


@dataclasses.dataclass(frozen=True)
class Tables:
    """The schedule as int32 arrays [ticks, S] the engine scans, and its buffer sizes.

    branch: ``branch_index`` of the action (0: idle); micro, virtual: the action's
    microbatch and chunk-on-device; stash, x_in, dy_in: the slot the action reads or writes
    (−1: none); w_stash: the slot B writes and W reads (split schedules: what B computed
    that W needs); x_arrive, dy_arrive: the slot the value received at this tick's start is
    stored in (−1: nothing arrives). sends_x / sends_dy [ticks]: some stage sends.
    """

    branch: np.ndarray
    micro: np.ndarray
    virtual: np.ndarray
    stash: np.ndarray
    x_in: np.ndarray
    dy_in: np.ndarray
    w_stash: np.ndarray
    x_arrive: np.ndarray
    dy_arrive: np.ndarray
    sends_x: np.ndarray
    sends_dy: np.ndarray
    stash_slots: int
    x_slots: int
    dy_slots: int
    w_slots: int
    period: int = 1
    variants: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 1), np.int32))

    def rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """The tables of (super) ticks [start, stop): [ticks·period, S] each."""
        names = ("branch", "micro", "virtual", "stash", "x_in", "dy_in", "w_stash", "x_arrive",
                 "dy_arrive")  # fmt: skip
        p = self.period
        return {name: getattr(self, name)[start * p : stop * p] for name in names}

    def segments(self) -> list[tuple[int, int, bool, bool]]:
        """Runs (start, stop, sends_x, sends_dy) of (super) ticks, each scanned with one send
        pattern.

        Between the first cotangent send and the last activation send (1F1B's steady state)
        one segment sends both ways every tick; elsewhere each run of ticks with the same
        pattern is its own segment. So a schedule has at most a few segments whatever M is
        (with S = 2, 1F1B's steady state alternates F and B every tick: one segment per tick
        would make the program, and its compile time, grow with M).
        """
        p = self.period
        x = [bool(self.sends_x[t * p : (t + 1) * p].any()) for t in range(len(self.sends_x) // p)]
        dy = [bool(self.sends_dy[t * p : (t + 1) * p].any()) for t in range(len(self.sends_x) // p)]
        ticks = len(x)
        start = dy.index(True) if True in dy else ticks
        stop = ticks - x[::-1].index(True) if True in x else 0
        if start >= stop:
            return _runs(x, dy, 0, ticks)
        return [*_runs(x, dy, 0, start), (start, stop, True, True), *_runs(x, dy, stop, ticks)]

    def sent(self) -> tuple[int, int]:
        """(ticks that send activations, ticks that send cotangents) as the engine runs them:
        one ``ppermute`` of one microbatch activation each."""
        segs = self.segments()
        return sum(b - a for a, b, sx, _ in segs if sx), sum(b - a for a, b, _, sd in segs if sd)


Segment = tuple[int, int, bool, bool]


def _runs(x: list[bool], dy: list[bool], start: int, stop: int) -> list[Segment]:
    """Maximal runs of ticks in [start, stop) with the same (x, dy) send pattern."""
    out: list[Segment] = []
    for tick in range(start, stop):
        key = (x[tick], dy[tick])
        if out and (out[-1][2], out[-1][3]) == key:
            out[-1] = (out[-1][0], tick + 1, *key)
        else:
            out.append((tick, tick + 1, *key))
    return out


def tables(schedule: Schedule) -> Tables:
    """Compiles a schedule into the engine's tables (slots by interval colouring per stage)."""
    S, C, T = schedule.stages, schedule.chunks, schedule.ticks
    when: dict[tuple[str, int, int], int] = {}
    for tick, row in enumerate(schedule.grid):
        for stage, a in enumerate(row):
            if a is not None:
                when[(a.kind, a.virtual * S + stage, a.micro)] = tick
    last_use = "W" if schedule.split else "B"
    stash, x_box, dy_box, w_box = {}, {}, {}, {}  # (chunk, micro) -> (stage, first, last tick)
    for (kind, c, m), tick in when.items():
        if kind != "F":
            continue
        stash[(c, m)] = (c % S, tick, when[(last_use, c, m)])
        if schedule.split:
            w_box[(c, m)] = (c % S, when[("B", c, m)], when[("W", c, m)])
        if c > 0:  # arrives the (super) tick after F on the previous chunk
            x_box[(c, m)] = (c % S, schedule.arrival(when[("F", c - 1, m)]), tick)
        start = tick if c == C - 1 else schedule.arrival(when[("B", c + 1, m)])
        dy_box[(c, m)] = (c % S, start, when[(last_use, c, m)])
    boxes = {"stash": stash, "x": x_box, "dy": dy_box, "w": w_box}
    slots = {name: _colour(box) for name, box in boxes.items()}

    def table(fill: int = -1) -> np.ndarray:
        return np.full((T, S), fill, np.int32)

    t = {k: table() for k in ("stash", "x_in", "dy_in", "w_stash", "x_arrive", "dy_arrive")}
    branch, micro, virtual = table(IDLE), table(0), table(0)
    for (kind, c, m), tick in when.items():
        s, v = c % S, c // S
        micro[tick, s], virtual[tick, s] = m, v
        branch[tick, s] = branch_index(kind, c == 0, c == C - 1)
        t["stash"][tick, s] = slots["stash"][(c, m)]
        t["dy_in"][tick, s] = slots["dy"][(c, m)]
        if kind in "BW" and schedule.split:
            t["w_stash"][tick, s] = slots["w"][(c, m)]
        if kind == "F" and c > 0:
            t["x_in"][tick, s] = slots["x"][(c, m)]
    for (c, m), (s, start, _) in x_box.items():
        t["x_arrive"][start, s] = slots["x"][(c, m)]
    for (c, m), (s, start, _) in dy_box.items():
        if c < C - 1:
            t["dy_arrive"][start, s] = slots["dy"][(c, m)]
    sends_x = np.zeros(T, bool)
    sends_dy = np.zeros(T, bool)
    for (kind, c, _m), tick in when.items():
        sends_x[tick] |= kind == "F" and c < C - 1
        sends_dy[tick] |= kind == "B" and c > 0
    sizes = {name: 1 + max(v.values(), default=0) for name, v in slots.items()}
    return Tables(
        branch, micro, virtual, t["stash"], t["x_in"], t["dy_in"], t["w_stash"], t["x_arrive"],
        t["dy_arrive"], sends_x, sends_dy, sizes["stash"], sizes["x"], sizes["dy"], sizes["w"],
        schedule.period, _variants(schedule, branch),
    )  # fmt: skip


def _variants(schedule: Schedule, branch: np.ndarray) -> np.ndarray:
    """``Tables.variants``: per super tick and phase, the branch every stage runs."""
    p = schedule.period
    out = np.zeros((len(branch) // p, p), np.int32)
    if p == 1:
        return out
    for tick, rows in enumerate(branch.reshape(-1, p, branch.shape[1])):
        for phase, (kind, row) in enumerate(zip(schedule.phases, rows, strict=True)):
            acting = row[row != IDLE] - 1
            if len(acting):
                first, last = bool((acting // 2 % 2).any()), bool((acting % 2).any())
                out[tick, phase] = branch_index(kind, first, last)
    return out


def branch_runs(schedule: Schedule) -> dict[tuple[int, int], np.ndarray]:
    """(segment k, branch b) -> runs per stage [S]: how many ticks of segment k each stage
    spends in branch b (``pipeline_grads``'s segments and ``branch_index``), and the segment
    lengths under key (k, −1). Uniform form: how many super ticks run variant b (the same on
    every stage)."""
    tab = tables(schedule)
    out: dict[tuple[int, int], np.ndarray] = {}
    for k, (start, stop, _, _) in enumerate(tab.segments()):
        out[(k, -1)] = np.full(schedule.stages, stop - start)
        if tab.period == 1:
            rows = tab.branch[start:stop]
            for b in np.unique(rows).tolist():
                out[(k, b)] = (rows == b).sum(axis=0)
            continue
        for b in np.unique(tab.variants[start:stop]).tolist():  # every stage runs each variant
            out[(k, b)] = np.full(schedule.stages, (tab.variants[start:stop] == b).sum())
    return out


def chunk_runs(schedule: Schedule, stage: int) -> dict[str, int]:
    """How often ``stage``'s device runs each part of the model in one step.

    "F", "B", "W": a chunk's forward, backward (split: its input-gradient half) and weight-
    gradient half; "first": the embedding's forward, "first_grad": its backward (in B, or W
    if split); "last": the loss with its gradient. Branch form: the stage's own actions (M·V
    of each kind; the ends M times, on the first / last stage only). Uniform form: every
    phase some stage runs, since each runs on every device (the ends whenever some stage
    needs them). A cost model scales its per-chunk terms by these.
    """
    if schedule.period == 1:
        kinds = [a.kind for row in schedule.grid if (a := row[stage]) is not None]
        first = schedule.micro if stage == 0 else 0  # chunk 0 lives on stage 0, C−1 on S−1
        last = schedule.micro if stage == schedule.stages - 1 else 0
        return {"F": kinds.count("F"), "B": kinds.count("B"), "W": kinds.count("W"),
                "first": first, "first_grad": first, "last": last}  # fmt: skip
    variants = tables(schedule).variants
    codes = variants - 1
    runs = {kind: int((variants[:, p] != IDLE).sum()) for p, kind in enumerate(schedule.phases)}

    def flags(phase: int, bit: int) -> int:
        return int(((variants[:, phase] != IDLE) & (codes[:, phase] // bit % 2 == 1)).sum())

    grad_phase = len(schedule.phases) - 1  # the embedding's backward: in B, or W if split
    return {"F": runs["F"], "B": runs["B"], "W": runs.get("W", 0), "first": flags(0, 2),
            "first_grad": flags(grad_phase, 2), "last": flags(0, 1)}  # fmt: skip


def _colour(intervals: dict[Any, tuple[int, int, int]]) -> dict[Any, int]:
    """Slot per key: per stage, closed [first, last] tick intervals sharing a slot never meet."""
    slots: dict[Any, int] = {}
    free_at: dict[int, list[int]] = {}  # stage -> per slot, the last tick it is busy
    for key, (stage, first, last) in sorted(intervals.items(), key=lambda kv: kv[1][1]):
        busy = free_at.setdefault(stage, [])
        slot = next((i for i, end in enumerate(busy) if end < first), len(busy))
        if slot == len(busy):
            busy.append(last)
        busy[slot] = last
        slots[key] = slot
    return slots


@dataclasses.dataclass(frozen=True)
class ForwardTables:
    """A schedule's forwards alone, as the int32 arrays [ticks, S] ``pipeline_forward`` scans.

    The schedule's F actions in their order, ticks without one dropped (the order, hence
    every dependency, is kept). branch: 0 idle, else 1 + 2·first chunk + last chunk; micro,
    virtual, x_in, x_arrive as in :class:`Tables`; sends [ticks]: some stage sends.
    """

    branch: np.ndarray
    micro: np.ndarray
    virtual: np.ndarray
    x_in: np.ndarray
    x_arrive: np.ndarray
    sends: np.ndarray
    x_slots: int

    def rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
        names = ("branch", "micro", "virtual", "x_in", "x_arrive")
        return {name: getattr(self, name)[start:stop] for name in names}

    def segments(self) -> list[tuple[int, int, bool]]:
        """Runs (start, stop, sends) of ticks with the same send pattern."""
        sends = self.sends.tolist()
        return [(a, b, x) for a, b, x, _ in _runs(sends, [False] * len(sends), 0, len(sends))]


def forward_tables(schedule: Schedule) -> ForwardTables:
    """The forward-only tables of ``schedule`` (for inference: no stash, no cotangents)."""
    S, C = schedule.stages, schedule.chunks
    rows = [[a if a is not None and a.kind == "F" else None for a in row] for row in schedule.grid]
    rows = [row for row in rows if any(a is not None for a in row)]
    when = {
        (a.virtual * S + s, a.micro): t
        for t, row in enumerate(rows)
        for s, a in enumerate(row)
        if a is not None
    }
    x_box = {(c, m): (c % S, when[(c - 1, m)] + 1, t) for (c, m), t in when.items() if c > 0}
    slots = _colour(x_box)
    shape = (len(rows), S)
    branch, micro, virtual = (np.zeros(shape, np.int32) for _ in range(3))
    x_in, x_arrive = np.full(shape, -1, np.int32), np.full(shape, -1, np.int32)
    sends = np.zeros(len(rows), bool)
    for (c, m), t in when.items():
        s = c % S
        branch[t, s] = 1 + 2 * (c == 0) + (c == C - 1)
        micro[t, s], virtual[t, s] = m, c // S
        sends[t] |= c < C - 1
        if c > 0:
            x_in[t, s] = slots[(c, m)]
            x_arrive[x_box[(c, m)][1], s] = slots[(c, m)]
    size = 1 + max(slots.values(), default=0)
    return ForwardTables(branch, micro, virtual, x_in, x_arrive, sends, size)


def forward_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """ppermute pairs stage s -> s+1 (wrapping round when chunks are interleaved, V > 1)."""
    S = schedule.stages
    return [(s, (s + 1) % S) for s in range(S if schedule.virtual > 1 else S - 1)]


def layer_order(depth: int, stages: int, virtual: int) -> np.ndarray:
    """order[p] = the model's layer stored at position p of a stacked layer dim split over
    ``stages`` devices with ``virtual`` chunks each.

    Position p = (s, v, j) (row-major over [S, V, depth/(S·V)]) is layer j of chunk v·S + s:
    each device's contiguous block holds its chunks s, s+S, ... in order. The identity unless
    V > 1.
    """
    per_chunk = depth // (stages * virtual)
    s, v, j = np.meshgrid(range(stages), range(virtual), range(per_chunk), indexing="ij")
    return ((v * stages + s) * per_chunk + j).reshape(-1)
