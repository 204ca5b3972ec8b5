"""Measured vs expected: a compiled program's ledger beside its expectation, ready to print.

``Report(ledger, expectation)`` sets ``comm.ledger``'s measurement beside an ``Expectation``
(``comm.terms``; a model's cost model builds one) per (kind, axes): ``rows``, ``to_json()``
(the ``shardkit inspect --json`` object), ``format()`` (a table) and ``contract_ok`` (counts
equal, bytes within 1%, patterns as declared). Model-free: ``models.vit.report`` compiles the
ViT's step and builds its report.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from shardkit.comm.ledger import KINDS, Ledger, Narrowing, Tally, shown_patterns, spanning
from shardkit.comm.terms import Expectation, compare, compare_patterns, kept_apart, total

Key = tuple[str, tuple[str, ...]]
RTOL = 0.01  # bytes may differ by 1% (the contract); counts must be equal


@dataclasses.dataclass(frozen=True)
class Row:
    """One (kind, axes): measured and expected executions per step and bytes sent per device."""

    kind: str
    axes: tuple[str, ...]
    count: int
    bytes_sent: float
    expected_count: int
    expected_bytes_sent: float
    exact: bool = True  # False: the expectation is an upper bound (``Expectation.exact``)
    # pattern -> ops and bytes, measured and expected (``ledger.Collective.pattern``)
    patterns: dict[str, Tally] = dataclasses.field(default_factory=dict)
    expected_patterns: dict[str, Tally] = dataclasses.field(default_factory=dict)
    # the ops held to the contract: ``count`` less the collectives the compiler kept apart
    # that the contract fuses (``Report.kept_apart``); None: ``count``
    held_count: int | None = None

    @property
    def ok(self) -> bool:
        key = (self.kind, self.axes)
        want = {key: Tally(self.expected_count, self.expected_bytes_sent)}
        held = self.count if self.held_count is None else self.held_count
        got = {key: Tally(held, self.bytes_sent)}
        if compare(want, got, RTOL, exact=self.exact):
            return False
        if not (self.patterns and self.expected_patterns):
            return True
        return not compare_patterns({key: self.expected_patterns}, {key: self.patterns}, (), RTOL)

    @property
    def pattern(self) -> str:
        """The measured patterns other than plain axis groups: ``shift +1 ×20, shift -1 ×20``."""
        return shown_patterns(self.patterns)

    def to_json(self) -> dict[str, Any]:
        fields = ("kind", "count", "bytes_sent", "expected_count", "expected_bytes_sent")

        def tallies(by: dict[str, Tally]) -> dict[str, Any]:
            return {p: {"count": t.count, "bytes_sent": t.bytes_sent} for p, t in by.items()}

        return {
            "axes": list(self.axes),
            **{f: getattr(self, f) for f in fields},
            "patterns": tallies(self.patterns),
            "expected_patterns": tallies(self.expected_patterns),
            "ok": self.ok,
        }


@dataclasses.dataclass(frozen=True)
class Report:
    """The measured ledger of one compiled train step beside its expectation.

    Attributes:
      ledger: what the compiled program does (``shardkit.ledger``).
      expectation: what it must do (``shardkit.cost``).
    """

    ledger: Ledger
    expectation: Expectation
    # A pipeline's other stages, (stage, their report); this one is the last stage's.
    others: tuple[tuple[int, Report], ...] = ()
    # Collectives the compiler narrowed (``ledger.widened``): ``ledger`` counts them at the
    # program's width, the contract holds them to what the program wrote, and the bytes sent
    # (``measured_bytes_sent``) are what the wire carries.
    narrowed: Narrowing = dataclasses.field(default_factory=Narrowing)
    # The compiler may keep apart collectives the contract fuses (``terms.kept_apart``): the
    # TPU compiler does past its combine threshold, XLA:CPU merges them.
    apart_ok: bool = False

    def _measured(self) -> tuple[dict[Key, dict[str, Tally]], list[str]]:
        """The ledger's patterns as held to the contract, and the rewrites named on the way
        (collectives kept apart, where ``apart_ok``)."""
        got = spanning(self.ledger.patterns())
        if not self.apart_ok:
            return got, []
        e = self.expectation
        return kept_apart(e.patterns(), e.unfused_patterns(), got, RTOL)

    @property
    def kept_apart(self) -> list[str]:
        """One sentence per (kind, axes) whose fused collectives the compiler kept apart."""
        return self._measured()[1]

    @property
    def rows(self) -> tuple[Row, ...]:
        """One row per (kind, axes) measured or expected, in ``ledger.KINDS`` order."""
        got_p, want_p = self._measured()[0], self.expectation.patterns()
        got, want = spanning(self.ledger.summary()), self.expectation.summary()
        zero = Tally(0, 0.0)
        keys = sorted(set(got) | set(want), key=_row_order)
        exact = self.expectation.exact
        return tuple(
            Row(k[0], k[1], *_pair(got.get(k, zero)), *_pair(want.get(k, zero)), exact,
                got_p.get(k, {}), want_p.get(k, {}), total(got_p.get(k, {})).count)
            for k in keys
        )  # fmt: skip

    @property
    def measured_bytes_sent(self) -> float:
        """Bytes per step sent by this device (a pipeline: by the busiest stage's)."""
        others = [r.measured_bytes_sent for _, r in self.others]
        return max([self.ledger.total_bytes_sent() - self.narrowed.bytes_saved, *others])

    @property
    def expected_bytes_sent(self) -> float:
        others = [r.expected_bytes_sent for _, r in self.others]
        return max([self.expectation.total_bytes_sent(), *others])

    @property
    def ratio(self) -> float:
        """Measured / expected bytes (1.0 = the minimum, exactly; 1.0 when both are 0)."""
        if self.expected_bytes_sent == 0:
            return 1.0 if self.measured_bytes_sent == 0 else math.inf
        return self.measured_bytes_sent / self.expected_bytes_sent

    @property
    def mismatches(self) -> list[str]:
        """One sentence per (kind, axes) that breaks the contract; [] when it holds."""
        e, led = self.expectation, self.ledger
        got = self._measured()[0]
        own = _inexact_counts(led)
        own += compare(e.summary(), {k: total(by) for k, by in got.items()}, RTOL, exact=e.exact)
        own += compare_patterns(e.patterns(), got, led.collectives, RTOL)
        if not self.others:
            return own
        last = len(self.others)  # the other stages are 0 .. S−2
        out = [f"stage {last}: {m}" for m in own]
        for stage, report in self.others:
            out += [f"stage {stage}: {m}" for m in report.mismatches]
        return out

    @property
    def contract_ok(self) -> bool:
        """Counts equal and bytes within 1%, per (kind, axes) (so in total too).

        Where the expectation is an upper bound (remat without a layer loop, ``Expectation.exact``):
        no more ops and bytes than expected.
        """
        return not self.mismatches

    def to_json(self) -> dict[str, Any]:
        """The ``shardkit inspect --json`` object (DESIGN.md keys, plus expectation fields)."""
        mem = self.ledger.memory
        return {
            **self.expectation.describe(),
            "collectives": [r.to_json() for r in self.rows],
            "measured_bytes_sent": self.measured_bytes_sent,
            "expected_bytes_sent": self.expected_bytes_sent,
            "ratio": self.ratio,
            "contract_ok": self.contract_ok,
            "contract_exact": self.expectation.exact,
            "mismatches": self.mismatches,
            "narrowed": dataclasses.asdict(self.narrowed),
            "kept_apart": self.kept_apart,
            "overlapped_fraction": self.ledger.overlapped_fraction,
            "overlapped_by_axes": overlapped_by_axes(self.ledger),
            **self._flops_json(),
            "memory": {
                "argument": mem.argument if mem else None,
                "output": mem.output if mem else None,
                "temp": mem.temp if mem else None,
            },
        }

    def _flops_json(self) -> dict[str, Any]:
        """ "flops": the busiest device's matmul FLOPs per step (``Ledger.flops``); under a
        pipeline also "stage_flops", one per stage."""
        stages = [r.ledger.flops for _, r in self.others] + [self.ledger.flops]
        out: dict[str, Any] = {"flops": max(stages)}
        return {**out, "stage_flops": stages} if self.others else out

    def format(self) -> str:
        """A table of measured vs expected per (kind, axes), totals, ratio, memory, verdict."""
        head = f"{'collective':<20}{'axes':<30}{'count':>7}{'expected':>9}{'bytes sent':>15}"
        head += f"{'expected':>15}  ok  pattern"
        lines = [self.expectation.title, head, "-" * len(head)]
        for r in self.rows:
            axes = ",".join(r.axes) or "-"
            lines.append(
                f"{r.kind:<20}{axes:<30}{r.count:>7}{r.expected_count:>9}{r.bytes_sent:>15,.0f}"
                f"{r.expected_bytes_sent:>15,.0f}  {'✓' if r.ok else '✗'}"
                + (f"  {r.pattern}" if r.pattern else "")
            )
        lines += [
            "-" * len(head),
            f"{'total per device per step':<66}{self.measured_bytes_sent:>15,.0f}"
            f"{self.expected_bytes_sent:>15,.0f}",
            f"measured / expected bytes: {self.ratio:.4f}",
            _memory_line(self.ledger),
            "contract: "
            + ("✓ holds" if self.contract_ok else "✗ " + " ".join(self.mismatches))
            + _bound_note(self.expectation),
            _narrowed_note(self.narrowed),
            *(f"kept apart by the compiler: {note}" for note in self.kept_apart),
        ]
        return "\n".join(line for line in lines if line)


def _bound_note(e: Expectation) -> str:
    """`` (an upper bound: why)`` where the expectation is not exact, else ""."""
    if e.exact:
        return ""
    return f" (an upper bound: {e.bound_why})" if e.bound_why else " (an upper bound)"


def _narrowed_note(n: Narrowing) -> str:
    if not n.count:
        return ""
    return (
        f"narrowed by the compiler: {n.count} collective(s) send 16-bit floats where the "
        f"program wrote 32-bit ones (their values feed bf16 matmul passes), {n.bytes_saved:,.0f} "
        "B fewer per step; counted as written in the rows, as sent in the total"
    )


def _inexact_counts(ledger: Ledger) -> list[str]:
    """The sentence that refuses a comparison the ledger cannot make: collectives inside a loop
    whose trip count neither the compiler nor the loop's form gives (each counted once)."""
    unknown = [c for c in ledger.collectives if not c.count_exact]
    if not unknown:
        return []
    where = ", ".join(sorted({f"{c.kind} over {'×'.join(c.axes) or 'none'}" for c in unknown}))
    return [
        f"{len(unknown)} collective(s) ({where}) run in a loop whose trip count could not be "
        "read (counted once), so counts and bytes cannot be held to the contract."
    ]


def _pair(t: Tally) -> tuple[int, float]:
    return t.count, t.bytes_sent


def _row_order(key: Key) -> tuple[int, tuple[str, ...]]:
    return KINDS.index(key[0]), key[1]


def overlapped_by_axes(ledger: Ledger) -> dict[str, float]:
    """``Ledger.overlapped_fraction`` of the collectives over each set of mesh axes ("model",
    "data×model", ...): whose bytes are hidden (TP's over model, DP's and FSDP's over data)."""
    sent: dict[str, list[float]] = {}
    for c in ledger.collectives:
        both = sent.setdefault("×".join(c.axes) or "none", [0.0, 0.0])
        both[0] += c.total_bytes_sent
        both[1] += c.total_bytes_sent if c.overlapped else 0.0
    return {axes: hidden / total for axes, (total, hidden) in sent.items() if total}


def _memory_line(ledger: Ledger) -> str:
    m = ledger.memory
    if m is None:
        return ""
    mib = 2.0**20
    line = (
        f"memory per device: argument {m.argument / mib:.2f} MiB, output {m.output / mib:.2f} "
        f"MiB, temp {m.temp / mib:.2f} MiB"
    )
    hidden = ledger.overlapped_fraction
    if not hidden:
        return line
    by = ", ".join(f"{axes} {f:.0%}" for axes, f in overlapped_by_axes(ledger).items())
    return f"{line}\noverlapped with a matmul: {hidden:.0%} of the bytes ({by})"
