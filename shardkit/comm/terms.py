"""Expected collectives: one ``Term`` type, an ``Expectation`` of them, and the comparison with a
measured ledger (``compare`` for ops and bytes per (kind, axes), ``compare_patterns`` for how
the devices are linked).

A term knows nothing of any model: a model's cost model (``models.vit.cost``) and a user's
contract (``comm.contract``) both build ``Term``s with the ring formulas of ``comm.bytes``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from shardkit.comm.ledger import GROUPS, Collective, Tally

Axes = tuple[str, ...]
Key = tuple[str, Axes]


@dataclasses.dataclass(frozen=True)
class Term:
    """One expected collective (or a family of identical ones) of a program: a model's cost
    term, or a collective a user declares in a contract (``contract.Expected`` is this type).

    Attributes:
      kind: a ``comm.ledger.KINDS`` name.
      axes: the mesh axes its device groups span, in mesh order.
      count: executions per step (a collective in the layer loop counts l times).
      bytes_sent: bytes one device sends over all ``count`` executions (ring model).
      what: what moves and why the step cannot do without it.
      phase: "forward", "backward", "recompute" (remat's second forward) or "step end".
      fused: terms with the same (kind, axes) and the same non-None ``fused`` group run as one
        op (XLA's all-reduce combiner); their counts are not added.
      pattern: how its devices are linked (``comm.ledger.Collective.pattern``): ``GROUPS`` (the
        replica groups are the mesh's groups along ``axes``) or, for a permute, the shift.
    """

    kind: str
    axes: Axes
    count: int
    bytes_sent: float
    what: str = ""
    phase: str = ""
    fused: str | None = None
    pattern: str = GROUPS


@dataclasses.dataclass(frozen=True)
class Expectation:
    """The expected collectives of one program: the contract its compiled HLO must meet.

    A model's cost model subclasses it to say what the program is (``title``, ``describe``),
    on which mesh (``axis_sizes``) and whether the terms are exact or an upper bound (``exact``).
    """

    terms: tuple[Term, ...]

    @property
    def exact(self) -> bool:
        """False where the terms are an upper bound: ``compare(..., exact=False)``."""
        return True

    @property
    def bound_why(self) -> str:
        """Why the terms are only an upper bound where ``exact`` is False ("": unsaid)."""
        return ""

    @property
    def title(self) -> str:
        """One line naming the program (a report's heading)."""
        return ""

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Mesh axis -> size, in mesh order, of the mesh the program runs on ({}: unknown)."""
        return {}

    def describe(self) -> dict[str, Any]:
        """JSON fields naming the program, placed first in a report's ``to_json``."""
        return {}

    def summary(self) -> dict[Key, Tally]:
        """(kind, axes) -> op executions and bytes sent per device (fused ops once)."""
        return {key: total(by) for key, by in self.patterns().items()}

    def patterns(self) -> dict[Key, dict[str, Tally]]:
        """``summary`` split by pattern: (kind, axes) -> pattern -> ops and bytes."""
        return patterns_of(self.terms)

    def unfused_patterns(self) -> dict[Key, dict[str, Tally]]:
        """``patterns`` with every fused group's terms counted as ops of their own: the most
        ops a compiler that merges none of them runs (``kept_apart``)."""
        return patterns_of(self.terms, fuse=False)

    def total_bytes_sent(self) -> float:
        """Bytes one device sends per call, over every collective."""
        return sum(term.bytes_sent for term in self.terms)

    def format(self) -> str:
        """One line per term: kind, axes, count, bytes, phase and why."""
        lines = [f"{'collective':<20}{'axes':<26}{'count':>7}{'bytes sent':>14}  phase: why"]
        for t in self.terms:
            axes = ",".join(t.axes) or "-"
            phase = t.phase + (" (fused)" if t.fused else "")
            lines.append(
                f"{t.kind:<20}{axes:<26}{t.count:>7}{t.bytes_sent:>14,.0f}  {phase}: {t.what}"
            )
        lines.append(f"{'total per device':<53}{self.total_bytes_sent():>14,.0f}")
        return "\n".join(lines)


def compare(
    expected: dict[Key, Tally],
    measured: dict[Key, Tally],
    rtol: float = 0.01,
    *,
    exact: bool = True,
) -> list[str]:
    """Where a measured summary breaks the contract: one sentence per (kind, axes), [] if none.

    The contract: the same (kind, axes) keys, equal op counts, and bytes within ``rtol``. With
    ``exact=False`` (``Expectation.exact``) the expectation is an upper bound: no unexpected
    keys, and counts and bytes at most the expected ones (bytes up to ``rtol`` above).
    """
    problems = []
    for key in sorted(set(expected) | set(measured)):
        want, got = expected.get(key, Tally(0, 0.0)), measured.get(key, Tally(0, 0.0))
        name = f"{key[0]} over {','.join(key[1]) or 'no axis'}"
        slack = rtol * max(want.bytes_sent, 1.0)
        over = got.bytes_sent - want.bytes_sent
        if got.count > want.count or (exact and got.count != want.count):
            problems.append(f"{name}: {got.count} ops measured, {want.count} expected.")
        if over > slack or (exact and -over > slack):
            problems.append(
                f"{name}: {got.bytes_sent:,.0f} bytes measured, {want.bytes_sent:,.0f} expected."
            )
    return problems


def patterns_of(terms: Iterable[Term], fuse: bool = True) -> dict[Key, dict[str, Tally]]:
    """(kind, axes) -> pattern -> ops and bytes of the terms (fused ones once per group, unless
    not ``fuse``)."""
    out: dict[Key, dict[str, Tally]] = {}
    seen: set[tuple[str, Axes, str, str]] = set()
    for term in terms:
        key, fused = (term.kind, term.axes), term.fused
        count = term.count
        if fused is not None and fuse:
            count = 0 if (*key, term.pattern, fused) in seen else 1
            seen.add((*key, term.pattern, fused))
        by = out.setdefault(key, {})
        t = by.get(term.pattern, Tally(0, 0.0))
        by[term.pattern] = Tally(t.count + count, t.bytes_sent + term.bytes_sent)
    return out


def kept_apart(
    expected: dict[Key, dict[str, Tally]],
    unfused: dict[Key, dict[str, Tally]],
    measured: dict[Key, dict[str, Tally]],
    rtol: float = 0.01,
) -> tuple[dict[Key, dict[str, Tally]], list[str]]:
    """Collectives the contract fuses (``Term.fused``) that a compiler kept apart: per (kind,
    axes) with more ops than ``expected`` but at most ``unfused`` (none merged), and the same
    bytes by pattern, the measured ops are counted as the contract's (``measured`` adjusted) and
    the rewrite named in one sentence. XLA:CPU merges such step-end all-reduces; the TPU
    compiler keeps them apart past its combine threshold (ViT-B/16's DP×TP: 2 over data)."""
    out, notes = dict(measured), []
    for key, want in expected.items():
        got = measured.get(key, {})
        few, most, have = total(want), total(unfused.get(key, {})), total(got)
        same_bytes = set(got) <= set(want) and all(
            _agree(Tally(0, w.bytes_sent), Tally(0, got[p].bytes_sent), rtol)
            for p, w in want.items() if p in got
        )  # fmt: skip
        if few.count < have.count <= most.count and same_bytes:
            out[key] = {p: Tally(want[p].count, t.bytes_sent) for p, t in got.items()}
            notes.append(f"{key[0]} over {','.join(key[1])}: {have.count} ops where the "
                         f"contract fuses them into {few.count}, the same bytes")  # fmt: skip
    return out, notes


def compare_patterns(
    expected: dict[Key, dict[str, Tally]],
    measured: dict[Key, dict[str, Tally]],
    collectives: Iterable[Collective],
    rtol: float = 0.01,
) -> list[str]:
    """Where the right amount moves the wrong way: one sentence per (kind, axes) whose total
    ops and bytes agree (``compare`` reports the rest) but whose split by pattern does not.

    The sentence names the expected and the measured patterns (ops and bytes of each) and the
    first measured op of a pattern the contract does not expect, with its source line.
    """
    ops = list(collectives)
    problems = []
    for key in sorted(set(expected) & set(measured)):
        want, got = expected[key], measured[key]
        by_pattern = (_agree(want.get(p), got.get(p), rtol) for p in set(want) | set(got))
        if not _agree(total(want), total(got), rtol) or all(by_pattern):
            continue
        mine = [c for c in ops if (c.kind, c.axes) == key]
        op = next((c for c in mine if c.pattern not in want), mine[0] if mine else None)
        where = "" if op is None else f" ({op.name}{f' at {op.source}' if op.source else ''}"
        where += "" if op is None else f" is {op.pattern})"
        problems.append(
            f"{key[0]} over {','.join(key[1])}: expected pattern {_patterns(want)}, measured "
            f"{_patterns(got)}{where}."
        )
    return problems


def total(by: dict[str, Tally]) -> Tally:
    """The ops and bytes of a pattern split, summed."""
    return Tally(sum(t.count for t in by.values()), sum(t.bytes_sent for t in by.values()))


def _agree(want: Tally | None, got: Tally | None, rtol: float) -> bool:
    """Equal op counts and bytes within ``rtol`` (a missing tally is zero)."""
    w, g = want or Tally(0, 0.0), got or Tally(0, 0.0)
    return w.count == g.count and abs(w.bytes_sent - g.bytes_sent) <= rtol * max(w.bytes_sent, 1)


def _patterns(by: dict[str, Tally]) -> str:
    """``shift +1: 20 ops, 696,320 B; shift -1: 20 ops, 696,320 B``."""
    return "; ".join(f"{p}: {t.count} ops, {t.bytes_sent:,.0f} B" for p, t in sorted(by.items()))
