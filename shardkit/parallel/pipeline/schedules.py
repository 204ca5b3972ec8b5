"""Pipeline schedules as data: per tick and per stage, which action runs.

A pipeline of S stages (devices along a ``stage`` axis) runs a model cut into S·V chunks
(layer groups): device s holds chunks s, s+S, ..., s+(V−1)·S (V > 1 only for ``interleaved``).
M microbatches pass every chunk forward (F) then backward. A schedule is a table
``grid[tick][stage]`` of :class:`Action` (or None: idle), built by one of

  gpipe(S, M)              all forwards, then all backwards (GPipe, Huang et al. 2019)
  one_f_one_b(S, M)        S−s−1 warm-up forwards, then one forward / one backward (PipeDream-
                           flush, Narayanan et al. 2019): at most S−s microbatches in flight
  interleaved(S, M, V)     1F1B over V chunks per device (Megatron-LM, Narayanan et al. 2021)
  zero_bubble(S, M)        ZB-H1 (Qi et al. 2023): the backward split into B (input gradient,
                           on the critical path) and W (weight gradient, deferred into bubbles)
  zbv(S, M)                ZB-V (Qi et al. 2023, §6; torchtitan's ScheduleZBVZeroBubble): two
                           chunks per stage in a V (stage s holds chunks s and 2S−1−s), the
                           backward split as in ZB-H1
  uniform(schedule)        any of them re-timed into super ticks of fixed phases, for the
                           engine's uniform form (a ``ppermute`` inside a chunk)
  phased(schedule)         the same super ticks, each stage on its own branch per phase: the
                           engine's form for schedules that mix F and B (no ``ppermute``)

Every action takes one tick (the papers' unit-time model: a tick is one chunk's F, B or W; an
unsplit backward B also computes W). The tables are produced by one simulator
(``_simulate``): each stage walks its own action order, running the next action as soon as
its dependencies ran on an earlier tick (data sent at tick t arrives at t + 1), and ZB-H1 runs
a deferred W whenever its next F or B is not ready. ``Schedule.check`` proves the invariants
the engine relies on; ``Schedule.bubble`` reads the idle fraction from the table.

Bubble fractions (idle ticks / all ticks, per stage): GPipe and 1F1B (S−1)/(M+S−1);
interleaved (S−1)/(V·M+S−1); ZB-H1 (S−1)/(3M+S−1); ZBV (S−1)/(6M+S−1) in ticks of half a
stage's layers (M ≥ S) — in ticks of one F, B or W each, where
1F1B's unsplit backward counts as one tick; measured on the same time scale (a full backward
= B + W = 2 ticks) 1F1B idles 3(S−1) of 3(M+S−1) while ZB-H1 idles S−1 of 3M+S−1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from shardkit.mesh import PlanError

KINDS = ("F", "B", "W")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv")


@dataclasses.dataclass(frozen=True)
class Action:
    """One tick of one stage: ``kind`` of microbatch ``micro`` on the stage's chunk ``virtual``.

    kind: "F" forward; "B" backward (with the weight gradient, unless the schedule splits it);
    "W" the weight gradient alone (split schedules). The model chunk is ``virtual·S + stage``.
    """

    kind: str
    micro: int
    virtual: int = 0

    def __str__(self) -> str:
        tag = f"{self.kind}{self.micro}"
        return tag if self.virtual == 0 else f"{tag}.{self.virtual}"


Grid = tuple[tuple[Action | None, ...], ...]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``grid[tick][stage]`` of actions, with its sizes.

    Attributes:
      name: "gpipe", "1f1b", "interleaved" or "zb".
      stages, micro, virtual: S, M, V.
      split: the backward is split into B (input gradient) and W (weight gradient).
      grid: ticks × stages.
      period: 1 for the branch form (a tick is one action per stage); P > 1 for the uniform
        form (``uniform``): tick t·P + p is phase p of super tick t and holds only actions of
        kind ``phases[p]``; data sent in a super tick arrives at the start of the next.
      masked (period > 1): True, the uniform form (every stage runs each phase some stage
        runs, masked where the action is not its own); False, the phased form (``phased``:
        the same super ticks, each stage on its own branch per phase, idle phases skipped).
    """

    name: str
    stages: int
    micro: int
    virtual: int
    split: bool
    grid: Grid
    period: int = 1
    masked: bool = True

    @property
    def form(self) -> str:
        """How the engine runs it: "branch", "phased" (``phased``) or "uniform" (``uniform``)."""
        if self.period == 1:
            return "branch"
        return "uniform" if self.masked else "phased"

    @property
    def phases(self) -> tuple[str, ...]:
        """The kinds a uniform super tick runs, in order (F, B and, if split, W)."""
        return KINDS if self.split else KINDS[:2]

    def chunk(self, stage: int, virtual: int) -> int:
        """The model chunk that ``stage`` holds as its chunk ``virtual``."""
        return _chunk(self.name == "zbv", self.stages, stage, virtual)

    def place(self, chunk: int) -> tuple[int, int]:
        """(stage, virtual) holding model chunk ``chunk``: v·S + s, or ZBV's V."""
        for stage in range(self.stages):
            for virtual in range(self.virtual):
                if self.chunk(stage, virtual) == chunk:
                    return stage, virtual
        raise ValueError(f"no chunk {chunk} in {self.name}")

    def arrival(self, tick: int) -> int:
        """The first tick that can read what ``tick`` sent to another stage."""
        return (tick // self.period + 1) * self.period

    @property
    def ticks(self) -> int:
        return len(self.grid)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def bubble(self) -> float:
        """The idle fraction of the table: idle (tick, stage) slots over all slots (uniform
        form: over the phases some stage runs; the others are skipped)."""
        rows = [row for row in self.grid if self.period == 1 or any(row)]
        idle = sum(action is None for row in rows for action in row)
        return idle / (len(rows) * self.stages)

    def in_flight(self, stage: int) -> int:
        """Peak microbatch-chunks whose activations ``stage`` holds (F done, weights not done)."""
        live = peak = 0
        for row in self.grid:
            action = row[stage]
            if action is None:
                continue
            if action.kind == "F":
                live += 1
            elif action.kind == ("W" if self.split else "B"):
                live -= 1
            peak = max(peak, live)
        return peak

    def check(self) -> None:
        """AssertionError unless every invariant the engine relies on holds.

        Every (chunk, microbatch) runs F once and B once (and W once if split) on the chunk's
        device; F(c, m) after F(c−1, m) arrived; B(c, m) after B(c+1, m) arrived and after
        F(c, m); W(c, m) after B(c, m); the grid has one action or None per (tick, stage), and
        in the uniform form only its phase's kind.
        """
        done: dict[tuple[str, int, int], int] = {}
        for tick, row in enumerate(self.grid):
            assert len(row) == self.stages, f"tick {tick} has {len(row)} stages"
            for stage, action in enumerate(row):
                if action is None:
                    continue
                assert action.kind in self.phases, action
                assert self.period == 1 or action.kind == self.phases[tick % self.period], action
                key = (action.kind, self.chunk(stage, action.virtual), action.micro)
                assert key not in done, f"{key} runs twice"
                assert 0 <= action.micro < self.micro and 0 <= action.virtual < self.virtual
                done[key] = tick
        for chunk in range(self.chunks):
            for m in range(self.micro):
                f, b = done[("F", chunk, m)], done[("B", chunk, m)]
                if chunk > 0:
                    arrived = self.arrival(done[("F", chunk - 1, m)])
                    assert arrived <= f, f"F{m} on chunk {chunk} too early"
                if chunk < self.chunks - 1:
                    arrived = self.arrival(done[("B", chunk + 1, m)])
                    assert arrived <= b, f"B{m} on chunk {chunk} too early"
                assert f < b, f"B{m} before F{m} on chunk {chunk}"
                if self.split:
                    assert b < done[("W", chunk, m)], f"W{m} before B{m} on chunk {chunk}"
        expected = self.chunks * self.micro * (3 if self.split else 2)
        assert len(done) == expected, f"{len(done)} actions, {expected} expected"

    def __str__(self) -> str:
        """The grid as the papers draw it: one row per stage, one column per tick (uniform
        form: per super tick, its phases' actions joined by +)."""
        p = self.period
        ticks = [self.grid[t : t + p] for t in range(0, self.ticks, p)]
        cells = [
            ["+".join(str(row[s]) for row in tick if row[s]) or "." for tick in ticks]
            for s in range(self.stages)
        ]
        width = max(len(c) for row in cells for c in row)
        form = "" if p == 1 else " (uniform)"
        lines = [
            f"{self.name}{form}: S={self.stages} M={self.micro} V={self.virtual}, "
            f"{len(ticks)} ticks, bubble {self.bubble():.3f}"
        ]
        for stage, row in enumerate(cells):
            lines.append(f"stage {stage}: " + " ".join(c.ljust(width) for c in row))
        return "\n".join(lines)


# ----------------------------------------------------------------------------- builders


def gpipe(stages: int, micro: int) -> Schedule:
    """GPipe: every forward, then every backward (reverse microbatch order is not needed)."""
    _check_sizes(stages, micro, 1)
    order = [[("F", m, 0) for m in range(micro)] + [("B", m, 0) for m in range(micro)]] * stages
    return _schedule("gpipe", stages, micro, 1, False, order)


def one_f_one_b(stages: int, micro: int) -> Schedule:
    """1F1B: stage s runs min(S−s−1, M) warm-up forwards, then alternates F and B."""
    _check_sizes(stages, micro, 1)
    order = [
        _one_f_one_b_order(min(stages - s - 1, micro), micro, 1, stages) for s in range(stages)
    ]
    return _schedule("1f1b", stages, micro, 1, False, order)


def interleaved(stages: int, micro: int, virtual: int) -> Schedule:
    """Interleaved 1F1B over V chunks per device; needs M divisible by S (Megatron's rule).

    Forwards go through microbatches in groups of S, chunk by chunk (for each group: chunk 0 of
    its S microbatches, then chunk 1, ...); backwards in the same order from the last chunk.
    Stage s warms up with 2(S−s−1) + (V−1)·S forwards (capped at V·M).
    """
    _check_sizes(stages, micro, virtual)
    if micro % stages:
        raise PlanError(
            f"The interleaved schedule needs the microbatches (M={micro}) divisible by the "
            f"stages (S={stages})."
        )
    orders = []
    for s in range(stages):
        warmup = min(2 * (stages - s - 1) + (virtual - 1) * stages, virtual * micro)
        orders.append(_one_f_one_b_order(warmup, micro, virtual, stages))
    return _schedule("interleaved", stages, micro, virtual, False, orders)


def zero_bubble(stages: int, micro: int) -> Schedule:
    """ZB-H1: 1F1B's F / B order; each W deferred until a tick where the next F or B is not
    ready (or where another F would hold more microbatches than 1F1B's peak, S on stage 0),
    so that the weight gradients fill the bubbles. Needs M >= S."""
    _check_sizes(stages, micro, 1)
    if micro < stages:
        raise PlanError(
            f"The zero-bubble schedule needs at least as many microbatches as stages "
            f"(M={micro} < S={stages})."
        )
    order = [
        _one_f_one_b_order(min(stages - s - 1, micro), micro, 1, stages) for s in range(stages)
    ]
    return _schedule("zb", stages, micro, 1, True, order)


def zbv(stages: int, micro: int) -> Schedule:
    """ZB-V: stage s holds chunks s and 2S−1−s, so a microbatch goes down the stages and back
    up (chunk 0, the embedding, and chunk 2S−1, the loss, both on stage 0; the turn, chunks
    S−1 and S, on stage S−1 without a send). Stage s runs torchtitan's ZBV order of F and B
    (its 2(S−s)−1 warm-up forwards on the first chunk, s pairs of both, S−s F/B on the second,
    then F/B pairs on each chunk in turn); each W is deferred as in ZB-H1, holding no more
    than 2S half-stage chunks (1F1B's S stages of activations). Needs M >= S."""
    _check_sizes(stages, micro, 1)
    if micro < stages:
        raise PlanError(
            f"The ZB-V schedule needs at least as many microbatches as stages "
            f"(M={micro} < S={stages})."
        )
    orders = [_zbv_order(stages, s, micro) for s in range(stages)]
    return _schedule("zbv", stages, micro, 2, True, orders)


def build(name: str, stages: int, micro: int, virtual: int = 1) -> Schedule:
    """The schedule called ``name`` (one of ``SCHEDULES``); PlanError for a bad combination."""
    if name not in SCHEDULES:
        raise PlanError(
            f"Unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}."
        )
    if virtual != 1 and name != "interleaved" and (name, virtual) != ("zbv", 2):
        raise PlanError(
            f"--virtual {virtual} only applies to the interleaved schedule, not {name!r}."
        )
    if name == "interleaved":
        return interleaved(stages, micro, virtual)
    if name == "zbv":
        return zbv(stages, micro)
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb": zero_bubble}[name](stages, micro)


def uniform(schedule: Schedule) -> Schedule:
    """``schedule`` re-timed into super ticks of fixed phases, for the engine's uniform form.

    The uniform form runs the same program on every device: each super tick runs phase F,
    then B (then W if split), and a phase runs on every stage whenever some stage has an
    action of its kind there (the others run it masked), so a collective inside a chunk (a
    ring's ``ppermute``) runs on every device at the same point. Each stage keeps the
    schedule's order with two liberties, so that one super tick can hold a forward and a
    backward: a forward may run ahead of pending backwards while the stage holds fewer than
    2·in_flight − 1 microbatch-chunks (1F1B's S becomes 2S − 1 on stage 0: a cotangent
    reaches the previous stage one super tick after its forward left, not one action after),
    and each W runs in its B's super tick (a W phase runs on every stage anyway, so deferring
    it fills no bubble). GPipe stays GPipe: no backward passes a forward.
    """
    if schedule.period != 1:
        return dataclasses.replace(schedule, masked=True)
    S = schedule.stages
    orders = [
        [(a.kind, a.micro, a.virtual) for row in schedule.grid if (a := row[s]) and a.kind != "W"]
        for s in range(S)
    ]
    caps = [max(1, 2 * schedule.in_flight(s) - 1) for s in range(S)]
    grid = _simulate_uniform(schedule, orders, caps)
    out = dataclasses.replace(schedule, grid=grid, period=len(schedule.phases))
    out.check()
    return out


def phased(schedule: Schedule) -> Schedule:
    """``schedule`` in the phased form: ``uniform``'s super ticks (F, B, then W if split),
    each stage on its own branch per phase, an idle phase computing nothing.

    For chunks without a ``ppermute`` (the branch form's condition). It pairs a forward and
    a backward in one super tick on every stage, where the branch form pairs one stage's
    forward with its neighbour's backward in one tick and waits for the slower: with the
    stages in lock step (a tick's permutes), 1F1B's steady tick then costs a backward on
    every stage instead of a forward plus a backward over two ticks. GPipe is the same in
    both forms (its ticks run one kind), so it is returned as is.
    """
    if schedule.name == "gpipe" and schedule.period == 1:
        return schedule
    return dataclasses.replace(uniform(schedule), masked=False)


def bubble_formula(name: str, stages: int, micro: int, virtual: int = 1) -> float:
    """The idle fraction each schedule's table must have (module docstring)."""
    s, m = stages, micro
    if name == "interleaved":
        return (s - 1) / (virtual * m + s - 1)
    if name == "zb":
        return (s - 1) / (3 * m + s - 1)
    if name == "zbv":
        return (s - 1) / (6 * m + s - 1)
    return (s - 1) / (m + s - 1)


# ----------------------------------------------------------------------------- simulation

Op = tuple[str, int, int]  # (kind, micro, virtual)


def _check_sizes(stages: int, micro: int, virtual: int) -> None:
    for name, value in (("stages", stages), ("microbatches", micro), ("virtual stages", virtual)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"A pipeline needs a positive number of {name}, got {value!r}.")


def _chunk_order(micro: int, virtual: int, stages: int) -> list[tuple[int, int]]:
    """(micro, virtual) in interleaved order: groups of S microbatches, chunk by chunk."""
    group = stages if virtual > 1 else micro
    return [
        (m, v)
        for start in range(0, micro, group)
        for v in range(virtual)
        for m in range(start, min(start + group, micro))
    ]


def _one_f_one_b_order(warmup: int, micro: int, virtual: int, stages: int) -> list[Op]:
    """``warmup`` forwards, then one forward / one backward pairs, then the last backwards."""
    forwards = [("F", m, v) for m, v in _chunk_order(micro, virtual, stages)]
    backwards = [("B", m, virtual - 1 - v) for m, v in _chunk_order(micro, virtual, stages)]
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards, strict=False):
        order += [f, b]
    return order + backwards[len(forwards) - warmup :]


def _zbv_order(stages: int, stage: int, micro: int) -> list[Op]:
    """Stage ``stage``'s F / B order in ZB-V (torchtitan's ``ScheduleZBVZeroBubble``), built
    for max(M, 2S − 1) microbatches and the extra ones dropped."""
    n = max(micro, 2 * stages - 1)
    count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    order: list[Op] = []

    def add(*ops: tuple[str, int]) -> None:
        for kind, v in ops:
            order.append((kind, count[(kind, v)], v))
            count[(kind, v)] += 1

    for _ in range(2 * (stages - stage) - 1):
        add(("F", 0))
    for _ in range(stage):
        add(("F", 1), ("F", 0))
    for _ in range(stages - stage):
        add(("F", 1), ("B", 1))
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < n:
        if count[("F", 0)] < n:
            add(("F", 0))
        add(("B", 0), ("F", 1), ("B", 1))
    for _ in range(stage):
        add(("B", 0), ("B", 1))
    for _ in range(stages - stage):
        add(("B", 0))
    return [op for op in order if op[1] < micro]


def _schedule(
    name: str, stages: int, micro: int, virtual: int, split: bool, orders: Sequence[list[Op]]
) -> Schedule:
    grid = _simulate(stages, micro, virtual, split, orders, name == "zbv")
    schedule = Schedule(name, stages, micro, virtual, split, grid)
    schedule.check()
    return schedule


def _chunk(v_shape: bool, stages: int, stage: int, virtual: int) -> int:
    """Chunk ``virtual`` of ``stage``: v·S + s, or in ZBV's V s (v = 0) and 2S − 1 − s."""
    if v_shape:
        return stage if virtual == 0 else 2 * stages - 1 - stage
    return virtual * stages + stage


def _simulate(
    stages: int, micro: int, virtual: int, split: bool, orders: Sequence[list[Op]],
    v_shape: bool = False,
) -> Grid:  # fmt: skip
    """Runs each stage's ``orders`` greedily: an action runs at the first tick its inputs are
    there (produced on an earlier tick). With ``split``, each B leaves a W pending, run at the
    first tick the stage's next F / B cannot run, and at the end."""
    chunks = stages * virtual
    finished: dict[tuple[str, int, int], int] = {}  # (kind, chunk, micro) -> tick
    position = [0] * stages
    pending: list[list[Op]] = [[] for _ in range(stages)]
    live = [0] * stages  # split schedules: forwards whose W has not run yet
    grid: list[tuple[Action | None, ...]] = []

    def ready(op: Op, stage: int, tick: int) -> bool:
        kind, m, v = op
        chunk = _chunk(v_shape, stages, stage, v)
        if kind == "F":
            return chunk == 0 or finished.get(("F", chunk - 1, m), tick) < tick
        after = ("F", chunk, m) if chunk == chunks - 1 else ("B", chunk + 1, m)
        return finished.get(after, tick) < tick

    total = sum(len(o) for o in orders) * (3 if split else 2) // 2
    while len(finished) < total:
        tick, row = len(grid), []
        if tick > 4 * total + 4:
            raise AssertionError("pipeline schedule deadlocked")
        for stage in range(stages):
            op: Op | None = None
            if position[stage] < len(orders[stage]):
                candidate = orders[stage][position[stage]]
                # ZB-H1 holds no more activations than 1F1B's first stage does: S microbatches
                # (ZBV: 2S half-stage chunks, the same memory).
                limit = 2 * stages if v_shape else stages
                full = candidate[0] == "F" and live[stage] >= limit and pending[stage]
                if ready(candidate, stage, tick) and not full:
                    op, position[stage] = candidate, position[stage] + 1
                    if split and candidate[0] == "B":
                        pending[stage].append(("W", candidate[1], candidate[2]))
            if op is None and pending[stage]:
                op = pending[stage].pop(0)
            if op is not None:
                finished[(op[0], _chunk(v_shape, stages, stage, op[2]), op[1])] = tick
                live[stage] += {"F": 1, "W": -1}.get(op[0], 0)
            row.append(None if op is None else Action(op[0], op[1], op[2]))
        grid.append(tuple(row))
    return tuple(grid)


def _simulate_uniform(schedule: Schedule, orders: list[list[Op]], caps: list[int]) -> Grid:
    """``uniform``'s list scheduler: super tick by super tick, phase by phase, each stage runs
    its first pending forward (if its inputs arrived and it holds fewer than ``caps[s]``), its
    next action if that is a ready backward, and (split) the W of its oldest finished B."""
    S, C, P = schedule.stages, schedule.chunks, len(schedule.phases)
    done: dict[tuple[str, int, int], int] = {}  # (kind, chunk, micro) -> fine tick
    left = [list(order) for order in orders]
    waiting_w: list[list[Op]] = [[] for _ in range(S)]
    live = [0] * S
    grid: list[tuple[Action | None, ...]] = []
    total = sum(map(len, orders)) * (3 if schedule.split else 2) // 2

    def arrived(key: tuple[str, int, int], tick: int) -> bool:
        return key in done and schedule.arrival(done[key]) <= tick

    def pick(stage: int, kind: str, tick: int) -> Op | None:
        if kind == "W":
            return waiting_w[stage].pop(0) if waiting_w[stage] else None
        ops = [op for op in left[stage] if op[0] == "F"][:1] if kind == "F" else left[stage][:1]
        for op in ops:
            _, m, v = op
            chunk = schedule.chunk(stage, v)
            if kind == "F" and (live[stage] >= caps[stage] or not (
                chunk == 0 or arrived(("F", chunk - 1, m), tick)
            )):  # fmt: skip
                return None
            if kind == "B" and (op[0] != "B" or not (
                ("F", chunk, m) in done if chunk == C - 1 else arrived(("B", chunk + 1, m), tick)
            )):  # fmt: skip
                return None
            left[stage].remove(op)
            return op
        return None

    while len(done) < total:
        if len(grid) > 8 * total * P:
            raise AssertionError("uniform pipeline schedule deadlocked")
        for kind in schedule.phases:
            tick, row = len(grid), []
            for stage in range(S):
                op = pick(stage, kind, tick)
                if op is not None:
                    done[(kind, schedule.chunk(stage, op[2]), op[1])] = tick
                    last_use = "W" if schedule.split else "B"
                    live[stage] += {"F": 1, last_use: -1}.get(kind, 0)
                    if kind == "B" and schedule.split:
                        waiting_w[stage].append(("W", op[1], op[2]))
                row.append(None if op is None else Action(kind, op[1], op[2]))
            grid.append(tuple(row))
    return tuple(grid)


__all__ = [
    "SCHEDULES",
    "Action",
    "Schedule",
    "bubble_formula",
    "build",
    "gpipe",
    "interleaved",
    "one_f_one_b",
    "uniform",
    "zbv",
    "zero_bubble",
]
