"""comm.hlo reads a loop's trip count from the loop itself when the compiler did not write it
(the TPU compiler's scans carry no ``known_trip_count``): exact for a counted loop, marked
inexact (counted once) for any other form, so a ledger never miscounts silently."""

from __future__ import annotations

import pytest

from shardkit.comm import hlo

LOOP = """HloModule m

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(BOUND)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (q: (s32[], f32[4])) -> (s32[], f32[4]) {
  %q = (s32[], f32[4]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %one = s32[] constant(STEP)
  %next = s32[] add(%j, %one)
  %x = f32[4] get-tuple-element(%q), index=1
  %ar = f32[4] all-reduce(%x), replica_groups={{0,1}}, to_apply=%sum
  ROOT %t = (s32[], f32[4]) tuple(%next, %ar)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4] parameter(0)
  %zero = s32[] constant(START)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[4]) tuple(%start, %x)
  %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[4] get-tuple-element(%w), index=1
}
"""


def _body_runs(start: int = 0, bound: int = 12, step: int = 1, known: str = "") -> tuple:
    text = LOOP.replace("BOUND", str(bound)).replace("STEP", str(step))
    text = text.replace("START", str(start)).replace("body=%body", "body=%body" + known)
    computations, entry = hlo.split_computations(text)
    return hlo.executions(computations, entry)["body"]


def test_a_counted_loop_without_known_trip_count_is_read_from_its_condition() -> None:
    assert _body_runs() == (12, True)
    assert _body_runs(start=2, bound=12) == (10, True)  # the copy of the start is followed


def test_the_compilers_known_trip_count_wins() -> None:
    known = ', backend_config={"known_trip_count":{"n":"5"}}'
    assert _body_runs(known=known) == (5, True)


@pytest.mark.parametrize("step", [2, 0])
def test_a_loop_of_another_form_counts_once_and_is_inexact(step: int) -> None:
    assert _body_runs(step=step) == (1, False)
