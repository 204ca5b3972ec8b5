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
# A tick's sends as switch branches where a kind's values go over several permutations (ZBV
# above S = 2): branch SEND_BRANCH[kind] + mask runs the permutations in the bitmask.
SEND_BRANCH = {"x": 100, "dy": 200}


def branch_index(kind: str, first: bool, last: bool) -> int:
    """The ``lax.switch`` branch of an action: idle is 0, then (kind, first chunk, last chunk)."""
    return 1 + 4 * KIND_INDEX[kind] + 2 * first + last


def branch_parts(branch: Any) -> tuple[Any, Any, Any]:
    """``branch_index`` undone, on an int or an array of them (0, idle, reads as F, False,
    False: mask it yourself): (kind index into ``KIND_INDEX``, first chunk, last chunk)."""
    code = branch - 1
    return code // 4, code // 2 % 2 == 1, code % 2 == 1


def merged_branch(kind: str, row: np.ndarray) -> int:
    """The uniform form's branch for a phase of ``kind`` whose stages hold ``row``: the kind
    with the first / last chunk parts if some stage needs them; 0 if no stage acts."""
    acting = row[row != IDLE]
    if not len(acting):
        return IDLE
    _, first, last = branch_parts(acting)
    return branch_index(kind, bool(first.any()), bool(last.any()))


@dataclasses.dataclass(frozen=True)
class Tables:
    """The schedule as int32 arrays [ticks, S] the engine scans, and its buffer sizes.

    branch: ``branch_index`` of the action (0: idle); micro, virtual: the action's
    microbatch and chunk-on-device; stash, x_in, dy_in: the slot the action reads or writes
    (−1: none); w_stash: the slot B writes and W reads (split schedules: what B computed
    that W needs); x_arrive, dy_arrive [ticks, S, permutes]: the slot the value each permute
    delivered at this tick's start is stored in (−1: nothing arrives); x_local, dy_local: the
    slot an F / B stores its own output in when the next chunk is on the same stage (ZBV's
    turn). x_carries, dy_carries [ticks]: a bit per permute that carries a value sent at
    that tick (``carried``; ``sends_x`` / ``sends_dy``: some stage sends). x_pairs,
    dy_pairs: the ``ppermute`` pairs of each permute that carries activations / cotangents.
    period: the schedule's (1: branch form; P: uniform form, tick t·P + p is phase p of super
    tick t). variants [super ticks, P] (uniform form): per phase, the ``branch_index`` every
    stage runs (its kind, with the first / last chunk parts if some stage needs them; each
    stage masks what is not its own), 0 where no stage acts and the phase is skipped.
    masked: the schedule's (period > 1: uniform form if True, phased form if False, where
    each stage runs its own ``branch`` per phase and ``variants`` is unused).
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
    x_carries: np.ndarray
    dy_carries: np.ndarray
    stash_slots: int
    x_slots: int
    dy_slots: int
    w_slots: int
    period: int = 1
    variants: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 1), np.int32))
    x_pairs: tuple[tuple[tuple[int, int], ...], ...] = ()
    dy_pairs: tuple[tuple[tuple[int, int], ...], ...] = ()
    x_local: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 1), np.int32))
    dy_local: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 1), np.int32))
    masked: bool = True

    @property
    def sends_x(self) -> np.ndarray:
        """[ticks] bool: some stage sends an activation."""
        return self.x_carries > 0

    @property
    def sends_dy(self) -> np.ndarray:
        """[ticks] bool: some stage sends a cotangent."""
        return self.dy_carries > 0

    def carried(self, start: int, stop: int, kind: str) -> np.ndarray:
        """Per (super) tick of [start, stop), the bitmask of ``kind``'s ("x" or "dy")
        permutes that carry a value then: a super tick sends what any of its phases made."""
        p = self.period
        masks = getattr(self, f"{kind}_carries")[start * p : stop * p].reshape(-1, p)
        return np.bitwise_or.reduce(masks, axis=1)

    def switched(self, segment: Segment) -> dict[str, np.ndarray]:
        """Per kind the engine sends by switch in ``segment`` (one it sends, over several
        permutes: ZBV above S = 2), its ticks' bitmasks (``carried``)."""
        start, stop, send_x, send_dy = segment
        return {
            kind: self.carried(start, stop, kind)
            for kind, pairs, on in (("x", self.x_pairs, send_x), ("dy", self.dy_pairs, send_dy))
            if on and len(pairs) > 1
        }

    def rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """The tables of (super) ticks [start, stop): [ticks·period, S] each (x_local and
        dy_local only where the schedule hands over on a stage: ZBV)."""
        names: tuple[str, ...] = ("branch", "micro", "virtual", "stash", "x_in", "dy_in",
                                  "w_stash", "x_arrive", "dy_arrive")  # fmt: skip
        names += tuple(n for n in ("x_local", "dy_local") if (getattr(self, n) >= 0).any())
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
        """(activation sends, cotangent sends) as the engine runs them, in ``ppermute``s of one
        microbatch activation: per tick of a sending segment one per permutation of the
        schedule's pairs where there is one (every tick, what it sends or zeros); where
        there are several (ZBV's two directions above S = 2), only those that carry a value
        that tick (``carried``)."""
        by_permute = self.sent_by_permute()
        return sum(by_permute["x"]), sum(by_permute["dy"])

    def sent_by_permute(self) -> dict[str, list[int]]:
        """``sent`` split by permute: per kind ("x", "dy"), the ``ppermute``s each of its
        permutations (``x_pairs`` / ``dy_pairs``) runs in one step."""
        out = {}
        for kind, pairs, flag in (("x", self.x_pairs, 2), ("dy", self.dy_pairs, 3)):
            segs = [seg for seg in self.segments() if seg[flag]]
            if len(pairs) > 1:
                masks = [self.carried(a, b, kind) for a, b, *_ in segs]
                out[kind] = [sum(int((m >> k & 1).sum()) for m in masks) for k in range(len(pairs))]
            else:
                out[kind] = [sum(b - a for a, b, *_ in segs)] * len(pairs)
        return out


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
                when[(a.kind, schedule.chunk(stage, a.virtual), a.micro)] = tick
    stage_of = {c: schedule.place(c)[0] for c in range(C)}
    x_moves = _Moves(schedule, when, stage_of, "F", -1)  # chunk c−1's F feeds chunk c's
    dy_moves = _Moves(schedule, when, stage_of, "B", +1)  # chunk c+1's B feeds chunk c's
    last_use = "W" if schedule.split else "B"
    stash, x_box, dy_box, w_box = {}, {}, {}, {}  # (chunk, micro) -> (stage, first, last tick)
    for (kind, c, m), tick in when.items():
        if kind != "F":
            continue
        s = stage_of[c]
        stash[(c, m)] = (s, tick, when[(last_use, c, m)])
        if schedule.split:
            w_box[(c, m)] = (s, when[("B", c, m)], when[("W", c, m)])
        if c > 0:
            x_box[(c, m)] = (s, x_moves.arrives(c, m), tick)
        start = tick if c == C - 1 else dy_moves.arrives(c, m)
        dy_box[(c, m)] = (s, start, when[(last_use, c, m)])
    boxes = {"stash": stash, "x": x_box, "dy": dy_box, "w": w_box}
    slots = {name: _colour(box) for name, box in boxes.items()}

    def table(fill: int = -1) -> np.ndarray:
        return np.full((T, S), fill, np.int32)

    t = {k: table() for k in ("stash", "x_in", "dy_in", "w_stash", "x_local", "dy_local")}
    branch, micro, virtual = table(IDLE), table(0), table(0)
    for (kind, c, m), tick in when.items():
        s, v = schedule.place(c)
        micro[tick, s], virtual[tick, s] = m, v
        branch[tick, s] = branch_index(kind, c == 0, c == C - 1)
        t["stash"][tick, s] = slots["stash"][(c, m)]
        t["dy_in"][tick, s] = slots["dy"][(c, m)]
        if kind in "BW" and schedule.split:
            t["w_stash"][tick, s] = slots["w"][(c, m)]
        if kind == "F" and c > 0:
            t["x_in"][tick, s] = slots["x"][(c, m)]
    x_arrive = x_moves.place(slots["x"], t["x_local"], T)
    dy_arrive = dy_moves.place(slots["dy"], t["dy_local"], T)
    sizes = {name: 1 + max(v.values(), default=0) for name, v in slots.items()}
    return Tables(
        branch, micro, virtual, t["stash"], t["x_in"], t["dy_in"], t["w_stash"], x_arrive,
        dy_arrive, x_moves.carries, dy_moves.carries, sizes["stash"], sizes["x"], sizes["dy"],
        sizes["w"], schedule.period, _variants(schedule, branch), x_moves.permutes,
        dy_moves.permutes, t["x_local"], t["dy_local"], schedule.masked,
    )  # fmt: skip


class _Moves:
    """How one kind's output reaches the chunk that reads it: activations from chunk c−1's F
    to chunk c, cotangents from chunk c+1's B to chunk c. Between stages by ``ppermute``
    (pairs grouped into as few permutations as possible: ``permutes``); on one stage (ZBV's
    turn) stored into the reader's slot by the producing action itself."""

    def __init__(self, schedule: Schedule, when: dict[tuple[str, int, int], int],
                 stage_of: dict[int, int], kind: str, step: int) -> None:  # fmt: skip
        self.schedule, self.when, self.kind, self.step = schedule, when, kind, step
        chunks = range(schedule.chunks)
        # reader chunk c <- producer chunk c + step, as (producer stage, reader stage)
        self.pair = {c: (stage_of[c + step], stage_of[c]) for c in chunks if c + step in chunks}
        self.permutes = _permutations(sorted({p for p in self.pair.values() if p[0] != p[1]}))
        self.carries = np.zeros(schedule.ticks, np.int32)  # a bit per permute carrying a value
        for c, (src, dst) in self.pair.items():
            if src != dst:
                k = next(i for i, pairs in enumerate(self.permutes) if (src, dst) in pairs)
                for m in range(schedule.micro):
                    self.carries[when[(kind, c + step, m)]] |= 1 << k
        self.sends = self.carries > 0

    def local(self, c: int) -> bool:
        src, dst = self.pair[c]
        return src == dst

    def arrives(self, c: int, m: int) -> int:
        """The first tick chunk c's value of microbatch m is in its reader's slot."""
        made = self.when[(self.kind, c + self.step, m)]
        return made if self.local(c) else self.schedule.arrival(made)

    def place(self, slots: dict[tuple[int, int], int], local: np.ndarray, ticks: int) -> np.ndarray:
        """arrive [ticks, S, permutes]: the slot a value received by each permute at a tick's
        start goes to (−1: none); ``local`` [ticks, S] filled with the slot a producing action
        stores its own output in."""
        arrive = np.full((ticks, self.schedule.stages, len(self.permutes)), -1, np.int32)
        for (c, m), slot in slots.items():
            if c not in self.pair:
                continue  # the last chunk's dy: stored by its own F
            src, dst = self.pair[c]
            if src == dst:
                local[self.when[(self.kind, c + self.step, m)], src] = slot
                continue
            k = next(i for i, pairs in enumerate(self.permutes) if (src, dst) in pairs)
            arrive[self.arrives(c, m), dst, k] = slot
        return arrive


def _permutations(pairs: list[tuple[int, int]]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``pairs`` split greedily into permutations (each source and each target once): one
    ``ppermute`` each. A chain s -> s+1 is one; ZBV's two directions are one at S = 2, two
    above (a stage sends down the V and up it)."""
    groups: list[list[tuple[int, int]]] = []
    for src, dst in pairs:
        group = next((g for g in groups if all(src != a and dst != b for a, b in g)), None)
        if group is None:
            groups.append(group := [])
        group.append((src, dst))
    return tuple(tuple(g) for g in groups)


def _variants(schedule: Schedule, branch: np.ndarray) -> np.ndarray:
    """``Tables.variants``: per super tick and phase, the branch every stage runs."""
    p = schedule.period
    out = np.zeros((len(branch) // p, p), np.int32)
    if p == 1:
        return out
    for tick, rows in enumerate(branch.reshape(-1, p, branch.shape[1])):
        for phase, (kind, row) in enumerate(zip(schedule.phases, rows, strict=True)):
            out[tick, phase] = merged_branch(kind, row)
    return out


def branch_runs(schedule: Schedule) -> dict[tuple[int, int], np.ndarray]:
    """(segment k, branch b) -> runs per stage [S]: how many ticks of segment k each stage
    spends in branch b (``pipeline_grads``'s segments and ``branch_index``), and the segment
    lengths under key (k, −1). Uniform form: how many super ticks run variant b (the same on
    every stage); phased form: how many phases each stage spends in branch b."""
    tab = tables(schedule)
    out: dict[tuple[int, int], np.ndarray] = {}
    for k, (start, stop, send_x, send_dy) in enumerate(tab.segments()):
        out[(k, -1)] = np.full(schedule.stages, stop - start)
        for kind, ticks in tab.switched((start, stop, send_x, send_dy)).items():
            masks, counts = np.unique(ticks, return_counts=True)  # the engine's send switch
            for mask, n in zip(masks.tolist(), counts.tolist(), strict=True):
                out[(k, SEND_BRANCH[kind] + mask)] = np.full(schedule.stages, n)
        if tab.period == 1 or not tab.masked:
            rows = tab.rows(start, stop)["branch"]
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
    of each kind; the ends M times, on the stages holding the first / last chunk: 0 and S − 1,
    or 0 for both in ZBV), and so in the phased form. Uniform form: every phase some stage
    runs, since each runs on every device (the ends whenever some stage needs them). A cost
    model scales its per-chunk terms by these.
    """
    if schedule.period == 1 or not schedule.masked:
        kinds = [a.kind for row in schedule.grid if (a := row[stage]) is not None]
        first = schedule.micro if schedule.place(0)[0] == stage else 0
        last = schedule.micro if schedule.place(schedule.chunks - 1)[0] == stage else 0
        return {"F": kinds.count("F"), "B": kinds.count("B"), "W": kinds.count("W"),
                "first": first, "first_grad": first, "last": last}  # fmt: skip
    variants = tables(schedule).variants
    runs = {kind: int((variants[:, p] != IDLE).sum()) for p, kind in enumerate(schedule.phases)}
    _, first, last = branch_parts(variants)
    acting = variants != IDLE
    grad_phase = len(schedule.phases) - 1  # the embedding's backward: in B, or W if split
    return {"F": runs["F"], "B": runs["B"], "W": runs.get("W", 0),
            "first": int((acting & first)[:, 0].sum()),
            "first_grad": int((acting & first)[:, grad_phase].sum()),
            "last": int((acting & last)[:, 0].sum())}  # fmt: skip


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
    virtual, x_in, x_arrive, x_local, x_pairs as in :class:`Tables`; sends [ticks]: some
    stage sends.
    """

    branch: np.ndarray
    micro: np.ndarray
    virtual: np.ndarray
    x_in: np.ndarray
    x_arrive: np.ndarray
    sends: np.ndarray
    x_slots: int
    x_local: np.ndarray
    x_pairs: tuple[tuple[tuple[int, int], ...], ...]

    def rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
        names: tuple[str, ...] = ("branch", "micro", "virtual", "x_in", "x_arrive")
        names += ("x_local",) if (self.x_local >= 0).any() else ()
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
    forwards = dataclasses.replace(schedule, grid=tuple(map(tuple, rows)), period=1)
    when = {
        ("F", schedule.chunk(s, a.virtual), a.micro): t
        for t, row in enumerate(rows)
        for s, a in enumerate(row)
        if a is not None
    }
    moves = _Moves(forwards, when, {c: schedule.place(c)[0] for c in range(C)}, "F", -1)
    x_box = {
        (c, m): (schedule.place(c)[0], moves.arrives(c, m), t)
        for (_, c, m), t in when.items()
        if c > 0
    }
    slots = _colour(x_box)
    shape = (len(rows), S)
    branch, micro, virtual = (np.zeros(shape, np.int32) for _ in range(3))
    x_in, x_local = np.full(shape, -1, np.int32), np.full(shape, -1, np.int32)
    for (_, c, m), t in when.items():
        s, v = schedule.place(c)
        branch[t, s] = 1 + 2 * (c == 0) + (c == C - 1)
        micro[t, s], virtual[t, s] = m, v
        if c > 0:
            x_in[t, s] = slots[(c, m)]
    x_arrive = moves.place(slots, x_local, len(rows))
    size = 1 + max(slots.values(), default=0)
    return ForwardTables(branch, micro, virtual, x_in, x_arrive, moves.sends, size, x_local,
                         moves.permutes)  # fmt: skip


def layer_order(depth: int, stages: int, virtual: int, v_shape: bool = False) -> np.ndarray:
    """order[p] = the model's layer stored at position p of a stacked layer dim split over
    ``stages`` devices with ``virtual`` chunks each.

    Position p = (s, v, j) (row-major over [S, V, depth/(S·V)]) is layer j of chunk v·S + s
    (``v_shape``, ZBV: chunk s for v = 0, 2S − 1 − s for v = 1): each device's contiguous block
    holds its chunks in order. The identity unless V > 1.
    """
    per_chunk = depth // (stages * virtual)
    s, v, j = np.meshgrid(range(stages), range(virtual), range(per_chunk), indexing="ij")
    chunk = np.where(v == 0, s, 2 * stages - 1 - s) if v_shape else v * stages + s
    return (chunk * per_chunk + j).reshape(-1)
