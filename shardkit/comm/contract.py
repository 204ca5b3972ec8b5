"""Communication contracts for any program: declare the collectives a function must run, then
hold its compiled HLO to them.

A model's cost model (``models.vit.cost``) derives its contract on paper; this module lets
you write one for your own model. Declare each collective with the ring formulas of
``comm.bytes`` (bytes SENT per device, DESIGN.md):

  all_reduce(axes, V, n)       2(n−1)/n · V      V: the reduced array's bytes
  all_gather(axes, V, n)       (n−1)/n · V       V: the gathered OUTPUT's bytes
  reduce_scatter(axes, V, n)   (n−1)/n · V       V: the INPUT's bytes
  all_to_all(axes, V, n)       (n−1)/n · V       V: the local block's bytes
  permute(axes, V, step=1)     V                 V: the block each device sends

each with a ``count`` (executions per call: a collective inside a ``scan`` of L steps counts L)
and a reason. ``assert_contract(fn, *args, expected=[...])`` compiles ``fn``, measures it with
``comm.ledger`` and raises an AssertionError listing every difference: per (kind, axes), the op
counts must be equal and the bytes within ``rtol``, and any collective not declared — a stray
all-gather from closing over a sharded array, an all-reduce autodiff inserted because a sync
axis was forgotten — is a difference too. By default a contract also says "no implicit
collectives": an all-reduce that autodiff inserted as the transpose of a cast ``check_vma``
made implicitly (``Collective.origin``) fails it, naming the source line.

A contract holds the pattern too (``comm.ledger.pattern_of``): every collective runs on its
axes' device groups, and a permute shifts by its ``step`` (linear index i -> i + step along its
axes). A ring that hops −1 where +1 is declared, a "bidirectional" ring sending every block one
way (declare it as two permutes, ``step=1`` and ``step=-1``, half the bytes each) or groups that
are not the axes' fail it, with the op and the expected and measured patterns named.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from shardkit.comm.bytes import (
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
    permute_bytes,
    reduce_scatter_bytes,
)
from shardkit.comm.ledger import (
    GROUPS,
    AnyMesh,
    Ledger,
    Tally,
    measure,
    shift,
    shown_patterns,
    spanning,
)
from shardkit.comm.terms import Term, compare, compare_patterns, patterns_of

Axes = tuple[str, ...]
# One declared collective: a ``terms.Term`` (kind, axes, count, bytes_sent, what, pattern).
Expected = Term
END = "step end"  # the phase of collectives after the backward (the optimizer update's)


def _expected(
    kind: str, axes: str | Iterable[str], each: float, count: int, why: str, pattern: str = GROUPS
) -> Expected:
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return Term(kind, names, count, count * each, why, pattern=pattern)


def all_reduce(
    axes: str | Iterable[str], v: float, n: int, count: int = 1, why: str = ""
) -> Expected:
    """``count`` all-reduces of ``v`` bytes over ``n`` devices: 2(n−1)/n · v each."""
    return _expected("all-reduce", axes, all_reduce_bytes(v, n), count, why)


def all_gather(
    axes: str | Iterable[str], v: float, n: int, count: int = 1, why: str = ""
) -> Expected:
    """``count`` all-gathers producing ``v`` bytes over ``n`` devices: (n−1)/n · v each."""
    return _expected("all-gather", axes, all_gather_bytes(v, n), count, why)


def reduce_scatter(
    axes: str | Iterable[str], v: float, n: int, count: int = 1, why: str = ""
) -> Expected:
    """``count`` reduce-scatters of a ``v``-byte input over ``n`` devices: (n−1)/n · v each."""
    return _expected("reduce-scatter", axes, reduce_scatter_bytes(v, n), count, why)


def all_to_all(
    axes: str | Iterable[str], v: float, n: int, count: int = 1, why: str = ""
) -> Expected:
    """``count`` all-to-alls of ``v`` local bytes over ``n`` devices: (n−1)/n · v each."""
    return _expected("all-to-all", axes, all_to_all_bytes(v, n), count, why)


def permute(
    axes: str | Iterable[str],
    v: float,
    count: int = 1,
    why: str = "",
    step: int = 1,
    n: int | None = None,
) -> Expected:
    """``count`` collective-permutes of a ``v``-byte block, v each, from linear index i to
    i + ``step`` along ``axes`` (some devices may send nothing, as at a pipeline's ends).

    ``n``: the devices along ``axes``. Pass it where ``step`` is not within (−n/2, n/2]: on
    2 devices +1 and −1 are the same permutation, measured as "shift +1".
    """
    pattern = shift(step, n)
    return _expected("collective-permute", axes, permute_bytes(v), count, why, pattern)


def summary(expected: Sequence[Expected]) -> dict[tuple[str, Axes], Tally]:
    """(kind, axes) -> declared executions and bytes, as ``Ledger.summary()`` measures them."""
    out: dict[tuple[str, Axes], Tally] = {}
    for e in expected:
        t = out.get((e.kind, e.axes), Tally(0, 0.0))
        out[(e.kind, e.axes)] = Tally(t.count + e.count, t.bytes_sent + e.bytes_sent)
    return out


def differences(
    ledger: Ledger, expected: Sequence[Expected], rtol: float = 0.01, implicit_ok: bool = False
) -> list[str]:
    """One sentence per (kind, axes) where ``ledger`` breaks the contract; [] if it holds.

    Collectives whose groups hold one device (an axis of size 1) send nothing and are ignored.
    Where a (kind, axes) moves the declared ops and bytes, their split by pattern must match
    too (``terms.compare_patterns``).
    Unless ``implicit_ok``, every collective autodiff inserted for an implicit ``check_vma``
    cast (``Collective.origin == "implicit"``) is a difference too, with its source line: it
    means a reduction the program does not say it makes.
    """
    problems = compare(summary(expected), spanning(ledger.summary()), rtol)
    problems += compare_patterns(patterns_of(expected), ledger.patterns(), ledger.collectives, rtol)
    if not implicit_ok:
        problems += [
            f"implicit {c.kind} over {','.join(c.axes)}: autodiff's transpose of a check_vma "
            f"implicit cast at {c.source} (a forgotten data.vary or sync axis?)."
            for c in ledger.implicit()
            if c.axes
        ]
    return problems


def format_diff(ledger: Ledger, expected: Sequence[Expected]) -> str:
    """Declared vs measured, one row per (kind, axes), the rows that differ (in ops, bytes or
    pattern) marked ✗, with the measured patterns other than axis groups."""
    want, got = summary(expected), spanning(ledger.summary())
    want_p, got_p = patterns_of(expected), ledger.patterns()
    lines = [f"{'collective':<20}{'axes':<20}{'count':>7}{'declared':>10}{'bytes':>14}"
             f"{'declared':>14}  ok  pattern"]  # fmt: skip
    for key in sorted(set(want) | set(got)):
        w, g = want.get(key, Tally(0, 0.0)), got.get(key, Tally(0, 0.0))
        wrong = compare({key: w}, {key: g}) or compare_patterns(
            {key: want_p.get(key, {})}, {key: got_p.get(key, {})}, ()
        )
        shown = shown_patterns(got_p.get(key, {}))
        lines.append(
            f"{key[0]:<20}{','.join(key[1]):<20}{g.count:>7}{w.count:>10}"
            f"{g.bytes_sent:>14,.0f}{w.bytes_sent:>14,.0f}  {'✗' if wrong else '✓'}"
            + (f"   {shown}" if shown else "")
        )
    return "\n".join(lines)


def assert_contract(
    fn: Callable[..., Any],
    *args: Any,
    expected: Sequence[Expected],
    mesh: AnyMesh | None = None,
    rtol: float = 0.01,
    implicit_ok: bool = False,
) -> Ledger:
    """Compiles ``fn(*args)``, holds its collectives to ``expected`` (and, unless
    ``implicit_ok``, to "no implicit collectives"; see ``differences``); returns the ledger.

    Raises:
      AssertionError: the differences, one per line, then the declared-vs-measured table.
    """
    ledger = measure(fn, *args, mesh=mesh)
    problems = differences(ledger, expected, rtol, implicit_ok)
    if problems:
        raise AssertionError(
            "communication contract broken:\n  "
            + "\n  ".join(problems)
            + "\n"
            + format_diff(ledger, expected)
        )
    return ledger


def zero1_terms(
    split_elements: int, replicated_elements: int, n: int, axis: str = "data", word: int = 4
) -> list[Term]:
    """ZeRO-1 (``data.zero1_update``): params replicated, optimizer state split over ``axis``.

    ``dw{U_X} --ReduceScatter--> dw[I_X]``, update the local slice with the local state, then
    ``w[I_X] --AllGather--> w[I]``: (n−1)/n·P·w + (n−1)/n·P·w = 2(n−1)/n·P·w, exactly one
    all-reduce's bytes, with 1/n of the optimizer state per device. Leaves that cannot be split
    (``replicated_elements``) are all-reduced whole. The formula for users of ``zero1_update`` in
    their own step (the ViT's ``--zero 1/2`` terms are ``models.vit.cost_params.zero_terms``).

    Args:
      split_elements: elements of the leaves split over ``axis`` (full, before the split).
      replicated_elements: elements of the leaves updated whole.
      n: the size of ``axis``.
      word: bytes per element (4: float32 gradients and params).
    """
    if n == 1:
        return []
    v, r = split_elements * word, replicated_elements * word
    terms = [
        Term("reduce-scatter", (axis,), 1, reduce_scatter_bytes(v, n), "gradient slices", END),
        Term("all-gather", (axis,), 1, all_gather_bytes(v, n), "updated param slices", END),
    ]
    if r:
        terms.append(Term("all-reduce", (axis,), 1, all_reduce_bytes(r, n), "unsplit", END))
    return terms
