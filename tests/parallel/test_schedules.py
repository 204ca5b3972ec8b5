"""Pipeline schedules as data: invariants, exact bubbles, memory, printing, errors.

The invariants are checked here by a checker written independently of ``Schedule.check``
(which ``build`` also runs), over every builder for S in 1..8, M in 1..16, V in 1..4.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.mesh import PlanError
from shardkit.parallel.pipeline import schedules as sc
from shardkit.parallel.pipeline.tables import tables

# Pure Python and fast: many more examples than the ci profile's default.
MANY = settings(max_examples=200)


@st.composite
def schedules(draw):
    name = draw(st.sampled_from(sc.SCHEDULES))
    stages = draw(st.integers(1, 8))
    if name == "interleaved":
        return sc.build(name, stages, stages * draw(st.integers(1, 16 // stages)),
                        draw(st.integers(1, 4)))  # fmt: skip
    low = stages if name in ("zb", "zbv") else 1
    return sc.build(name, stages, draw(st.integers(low, max(low, 16))))


def times(schedule):
    """(kind, chunk, micro) -> tick, asserting nothing runs twice."""
    out = {}
    for tick, row in enumerate(schedule.grid):
        assert len(row) == schedule.stages  # one action (or idle) per stage and tick
        for stage, action in enumerate(row):
            if action is not None:
                key = (action.kind, schedule.chunk(stage, action.virtual), action.micro)
                assert key not in out, key
                out[key] = tick
    return out


@MANY
@given(schedules())
def test_every_microbatch_passes_every_chunk_once_in_dependency_order(schedule):
    t = times(schedule)
    kinds = ("F", "B", "W") if schedule.split else ("F", "B")
    chunks, micro = schedule.chunks, schedule.micro
    assert set(t) == {(k, c, m) for k in kinds for c in range(chunks) for m in range(micro)}
    for c in range(chunks):
        for m in range(micro):
            assert c == 0 or t["F", c - 1, m] < t["F", c, m]
            assert c == chunks - 1 or t["B", c + 1, m] < t["B", c, m]
            assert t["F", c, m] < t["B", c, m]
            assert not schedule.split or t["B", c, m] < t["W", c, m]


@MANY
@given(schedules())
def test_bubble_read_from_the_table_equals_its_formula(schedule):
    s, m, v = schedule.stages, schedule.micro, schedule.virtual
    idle = sum(a is None for row in schedule.grid for a in row)
    measured = Fraction(idle, schedule.ticks * s)
    formula = {
        "gpipe": Fraction(s - 1, m + s - 1),
        "1f1b": Fraction(s - 1, m + s - 1),
        "interleaved": Fraction(s - 1, v * m + s - 1),
        "zb": Fraction(s - 1, 3 * m + s - 1),
        "zbv": Fraction(s - 1, 6 * m + s - 1),  # ticks of half a stage's layers
    }[schedule.name]
    assert measured == formula
    assert schedule.bubble() == pytest.approx(float(formula))
    assert sc.bubble_formula(schedule.name, s, m, v) == pytest.approx(float(formula))


@MANY
@given(st.integers(2, 8), st.integers(1, 16))
def test_zero_bubble_idles_less_than_one_f_one_b_on_the_same_time_scale(stages, micro):
    """1F1B's unsplit backward is B + W: on a scale of one F, B or W per unit, 1F1B idles
    3(S−1) of 3(M+S−1) units, ZB-H1 S−1 of 3M+S−1."""
    micro = max(micro, stages)
    zb, ofob = sc.zero_bubble(stages, micro), sc.one_f_one_b(stages, micro)
    ofob_idle = Fraction(3 * (stages - 1), 3 * (micro + stages - 1))
    assert zb.bubble() < float(ofob_idle) == pytest.approx(ofob.bubble())


def warmup_forwards(schedule) -> list[int]:
    """Per stage, the forwards that run before its first backward, from the grid."""
    out = []
    for stage in range(schedule.stages):
        kinds = [row[stage].kind for row in schedule.grid if row[stage] is not None]
        out.append(kinds.index("B"))
    return out


@MANY
@given(schedules())
def test_warm_up_and_in_flight_are_the_papers_numbers(schedule):
    """Exact per stage s, independent of the builders (M ≥ S for ZB-H1):
    GPipe all M forwards, in flight M; 1F1B S−s forwards, in flight min(S−s, M);
    interleaved Megatron's 2(S−s−1) + (V−1)·S warm-up forwards plus the first steady-state
    one (capped at V·M), all in flight; ZB-H1 1F1B's forwards, S in flight on every stage
    (the W it defers keeps later stages at the first stage's peak, never above); ZBV
    torchtitan's 2(S−s)−1 + s forwards on the first chunk and s + 1 on the second (capped at
    M), 2S half-stage chunks in flight on every stage."""
    s_, m, v = schedule.stages, schedule.micro, schedule.virtual
    stages = range(s_)
    warm = {
        "gpipe": [m] * s_,
        "1f1b": [min(s_ - s, m) for s in stages],
        "zb": [min(s_ - s, m) for s in stages],
        "interleaved": [min(2 * (s_ - s - 1) + (v - 1) * s_ + 1, v * m) for s in stages],
        "zbv": [min(2 * (s_ - s) - 1 + s, m) + min(s + 1, m) for s in stages],
    }[schedule.name]
    peak = {"zb": [s_] * s_, "zbv": [2 * s_] * s_}.get(schedule.name, warm)
    assert warmup_forwards(schedule) == warm
    assert [schedule.in_flight(s) for s in stages] == peak


@MANY
@given(schedules())
def test_engine_sends_counted_from_the_grid(schedule):
    """The permutes the engine runs (and the cost model charges), from the grid alone: an
    activation leaves at every F of a chunk but the last, a cotangent at every B of a chunk
    but the first (never at a W) whose neighbour chunk is on another stage (ZBV's turn stays
    on its stage); between the first cotangent and the last activation every tick sends both
    ways (one scanned segment). ZBV above S = 2 sends down its V and up it (two
    permutations): a tick runs only those its values travel on. ``Tables.sent`` must agree."""
    last = schedule.chunks - 1
    x_ticks, dy_ticks = {}, {}  # tick -> the (source, target) stages of what leaves then
    for tick, row in enumerate(schedule.grid):
        for stage, a in enumerate(row):
            if a is None:
                continue
            chunk = schedule.chunk(stage, a.virtual)
            if a.kind == "F" and chunk < last and (to := schedule.place(chunk + 1)[0]) != stage:
                x_ticks.setdefault(tick, set()).add((stage, to))
            if a.kind == "B" and chunk > 0 and (to := schedule.place(chunk - 1)[0]) != stage:
                dy_ticks.setdefault(tick, set()).add((stage, to))
    steady = set(range(min(dy_ticks), max(x_ticks) + 1)) if x_ticks and dy_ticks else set()
    tab = tables(schedule)
    two = schedule.name == "zbv" and schedule.stages > 2
    assert (
        len(tab.x_pairs) == len(tab.dy_pairs) == ((2 if two else 1) if schedule.stages > 1 else 0)
    )

    def sent(ticks, permutations):
        if not two:
            return len(set(ticks) | steady) * len(permutations)
        return sum(len({i for i, p in enumerate(permutations) for pair in pairs if pair in p})
                   for pairs in ticks.values())  # fmt: skip

    assert tab.sent() == (sent(x_ticks, tab.x_pairs), sent(dy_ticks, tab.dy_pairs))
    assert set(np.flatnonzero(tab.sends_x)) == set(x_ticks)
    assert set(np.flatnonzero(tab.sends_dy)) == set(dy_ticks)


def test_the_grid_prints_like_the_papers_figures():
    text = str(sc.one_f_one_b(4, 6))
    assert text.splitlines()[0] == "1f1b: S=4 M=6 V=1, 18 ticks, bubble 0.333"
    row = "stage 0: F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 .  B3 .  B4 .  B5"
    assert text.splitlines()[1].rstrip() == row
    assert "F1.1" in str(sc.interleaved(2, 4, 2))  # microbatch 1 on the device's second chunk
    assert "W0" in str(sc.zero_bubble(2, 2))


@pytest.mark.parametrize(
    "args, match",
    [
        (("interleaved", 4, 6, 2), r"microbatches \(M=6\) divisible by the stages \(S=4\)"),
        (("zb", 4, 3), r"at least as many microbatches as stages \(M=3 < S=4\)"),
        (("1f1b", 4, 8, 2), "--virtual 2 only applies to the interleaved schedule, not '1f1b'"),
        (("pipedream", 4, 8), "Unknown pipeline schedule 'pipedream'"),
        (("gpipe", 0, 8), "positive number of stages, got 0"),
        (("gpipe", 2, 0), "positive number of microbatches, got 0"),
    ],
)
def test_bad_sizes_are_one_sentence(args, match):
    with pytest.raises(PlanError, match=match) as err:
        sc.build(*args)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")


@MANY
@given(schedules())
def test_the_uniform_form_keeps_every_dependency_across_super_ticks(schedule):
    """``uniform``: the same actions; each phase row holds only its kind; what crosses to
    another chunk is read only from the next super tick on (one send per super tick); each
    stage keeps its forwards' and its backwards' order."""
    u = sc.uniform(schedule)
    p = u.period
    t = times(u)
    assert set(t) == set(times(schedule))
    for tick, row in enumerate(u.grid):
        assert all(a is None or a.kind == u.phases[tick % p] for a in row)
    for (kind, c, m), tick in t.items():
        if kind == "F" and c > 0:
            assert t["F", c - 1, m] // p < tick // p
        if kind == "B" and c < u.chunks - 1:
            assert t["B", c + 1, m] // p < tick // p

    def order(grid, stage, kind):
        return [a for row in grid if (a := row[stage]) and a.kind == kind]

    for s in range(u.stages):
        for kind in u.phases:
            assert order(u.grid, s, kind) == order(schedule.grid, s, kind)


def lock_step_cost(schedule):
    """The step time of ``schedule`` as the engine runs its form on stages in lock step (each
    tick's or super tick's permutes wait for every stage): per (super) tick, the busiest
    stage's actions, in layer units (F = 1, an unsplit B = 2, a split B or W = 1; a chunk of
    interleaved or ZBV is 1/V of the layers)."""
    unit = {"F": 1, "B": 1 if schedule.split else 2, "W": 1}
    p = schedule.period
    return sum(
        Fraction(max(sum(unit[a.kind] for row in ticks if (a := row[s])) for s in
                     range(schedule.stages)), schedule.virtual)
        for ticks in (schedule.grid[t : t + p] for t in range(0, schedule.ticks, p))
    )  # fmt: skip


@MANY
@given(schedules())
def test_the_phased_form_is_never_slower_than_gpipe_in_lock_step(schedule):
    """``phased``: uniform's super ticks, each stage on its own branch per phase. Its lock-step
    cost is at most GPipe's on the same S and M (the branch form's 1F1B is not: a tick pairing
    one stage's F with another's B costs a B), and GPipe stays in the branch form."""
    ph = sc.phased(schedule)
    assert ph.form == ("branch" if schedule.name == "gpipe" else "phased")
    assert set(times(ph)) == set(times(schedule))  # the same actions, re-timed
    gpipe = lock_step_cost(sc.gpipe(schedule.stages, schedule.micro))
    assert lock_step_cost(ph) <= gpipe
    if schedule.name == "1f1b" and schedule.stages > 1 and schedule.micro > schedule.stages:
        assert lock_step_cost(schedule) > gpipe  # why the branch form is not used for it
    assert sc.uniform(ph).form == "uniform"  # a ring inside the chunks: masked phases


@MANY
@given(schedules())
def test_no_uniform_schedule_is_slower_than_gpipe_and_steady_ones_hold_2s_minus_1(schedule):
    """In the uniform form a super tick costs the phases some stage runs: no schedule runs more
    F or B phases than GPipe on the same S and M (1F1B and ZB-H1 exactly as many), and 1F1B
    and ZB-H1 hold at most 2S − 1 microbatches per stage whatever M (GPipe: M)."""
    u = sc.uniform(schedule)
    gpipe = sc.uniform(sc.gpipe(schedule.stages, schedule.micro))
    phases_run = lambda s, k: sum(any(row) for row in s.grid[s.phases.index(k) :: s.period])  # noqa: E731
    for kind in ("F", "B"):
        # interleaved runs chunks of 1/V the layers: compare in layer units
        assert phases_run(u, kind) <= phases_run(gpipe, kind) * u.virtual, kind
    if schedule.name in ("1f1b", "zb"):
        assert phases_run(u, "F") == phases_run(gpipe, "F")
        assert max(u.in_flight(s) for s in range(u.stages)) <= 2 * u.stages - 1
    if schedule.name == "gpipe":
        assert u.in_flight(0) == u.micro
