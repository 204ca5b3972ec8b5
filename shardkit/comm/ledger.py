"""The ledger: every collective a compiled program runs, how often, and how many bytes it sends.

``measure(fn, *args, mesh=mesh)`` compiles ``fn`` (``jax.jit(fn).lower(*args).compile()``), parses
the compiled HLO text with :func:`parse_hlo` and returns a :class:`Ledger`: one
:class:`Collective` per collective instruction, plus XLA's per-device memory and flop figures.
:func:`format_table` renders a ledger for the ``shardkit inspect`` command.

What is counted
  The five collectives ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``collective-permute``
  and ``all-to-all``. An async pair (``all-gather-start`` / ``all-gather-done``, likewise for
  the other four) is one collective, recorded at its start. An un-sugared async wrapper
  (``async-start`` with ``calls=``) is followed into its wrapped computation and the collective
  there is recorded. The TPU compiler's async collective fusion (a start fusion, fusions
  carrying it on beside compute, a done fusion, each holding a copy of the collective: see
  ``comm.schedule``) is one collective, recorded at its start. A combined op (all-reduce or
  all-to-all with a tuple result) is one record whose bytes are the sum over the tuple.

How often: ``count``, executions per call of the program
  The call graph is followed from ``ENTRY`` through ``calls=``, ``to_apply=``, ``body=``,
  ``condition=`` and the branch computations. A ``while`` body runs its ``known_trip_count``
  times (its condition once more), so a collective in a ``lax.scan`` of length L counts L and
  nested loops multiply. A loop without a known trip count is counted as running once and its
  collectives get ``count_exact=False``. Every branch of a ``conditional`` is counted as if it
  ran. Computations that ``ENTRY`` never reaches run 0 times and contribute no records.

Bytes sent per device per execution: ``bytes_sent``, ``comm.bytes``' ring model (DESIGN.md)
  n is ``group_size``, the number of devices in one replica group. Collective-permute rule: a
  device sends its V bytes once per pair it is the source of; ``bytes_sent`` is what the busiest
  device sends (V for any permutation), because the step waits for that device. So a permute in
  which only some devices send (``source_target_pairs`` not a full permutation, e.g. a
  non-wrapping shift) still costs V; a pair from a device to itself moves nothing and is dropped.
  Its ``group_size`` is the largest set of devices linked to each other by pairs.

Devices and axes
  Ids in replica groups and pairs are positions in the program's device assignment, which for a
  program compiled over ``mesh`` is ``mesh.devices.flat``. Given the mesh, ``axes`` names the mesh
  axes along which the devices of a group (or of a source/target pair) differ: groups
  {0,1},{2,3},... on data=4 x model=2 span ("model",). Without a mesh, ``axes`` is (). Every
  printed spelling is understood: ``{{0,1},{2,3}}``, ``{}`` (all devices), ``[4,2]<=[8]``,
  ``[2,4]<=[4,2]T(1,0)`` and ``mesh['a'=4,'b'=2] {'b'}`` (with ``device_ids=(...)`` and
  sub-axes ``'a':(1)2``).

Memory and flops (per device)
  ``Ledger.memory``: ``compiled.memory_analysis()``. ``Ledger.xla_flops``: ``cost_analysis()``'s
  flops as-is, a lower bound for scanned layers (XLA counts a loop body once). ``Ledger.flops``
  counts every ``dot`` and ``convolution`` (``Ledger.matmuls``) times its executions, by the
  collectives' call counts (every branch of a conditional as if it ran; a pipeline's
  per-stage count weighs each branch by its ticks).
"""

from __future__ import annotations

import dataclasses
import linecache
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from shardkit.comm import hlo, schedule
from shardkit.comm.bytes import sent
from shardkit.comm.hlo import KINDS, Matmul, parse_matmuls

__all__ = [
    "GROUPS",
    "KINDS",
    "ORIGINS",
    "Collective",
    "Ledger",
    "Memory",
    "Tally",
    "exchange",
    "format_table",
    "ledger_of",
    "measure",
    "parse_hlo",
    "pattern_of",
    "shift",
    "shown_patterns",
]

AnyMesh = Mesh | AbstractMesh


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
      kind: one of ``KINDS`` (async ``-start`` suffix removed).
      group_size: devices per replica group (collective-permute: the largest set of devices
        linked by source/target pairs).
      axes: mesh axes the groups (or pairs) span, in mesh order; () without a mesh.
      shapes: the result shape of each tuple element (one entry for an array result).
      dtypes: the element type of each tuple element, as HLO spells it (``f32``, ``bf16``).
      result_bytes: bytes of the result on one device, summed over the tuple.
      bytes_sent: bytes one device sends per execution (ring model, see the module docstring).
      count: executions per call of the program (product of enclosing loop trip counts).
      name: the HLO instruction name.
      op_name: the JAX op that produced it (``metadata={op_name=...}``), e.g.
        ``jit(f)/shard_map/psum``.
      source: ``file:line`` of the JAX call, where the HLO records it; else "".
      computation: the HLO computation that holds the instruction.
      replica_groups: the device groups (empty for collective-permute).
      source_target_pairs: the (source, target) pairs of a collective-permute.
      pattern: how its devices are linked (``pattern_of``): ``GROUPS`` when the replica groups
        are exactly the partition of the mesh along ``axes``; ``shift(k, n)`` ("shift +1",
        "shift -1") when every pair sends from linear index i to i + k mod n over ``axes``,
        ``exchange(d, n)`` ("xor 1") for i with i XOR d; else explicit groups/pairs; "" meshless.
      count_exact: False when an enclosing loop has no known trip count (``count`` then counts
        that loop once).
      overlapped: an async collective with a matmul scheduled between its start and done
        (``comm.schedule``; also the TPU compiler's async collective fusions): its transfer
        can hide behind compute.
    """

    kind: str
    group_size: int
    axes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    result_bytes: int
    bytes_sent: float
    count: int
    name: str
    op_name: str
    source: str
    computation: str
    replica_groups: tuple[tuple[int, ...], ...] = ()
    source_target_pairs: tuple[tuple[int, int], ...] = ()
    pattern: str = ""
    count_exact: bool = True
    overlapped: bool = False

    @property
    def total_bytes_sent(self) -> float:
        """Bytes one device sends over all executions in one call: ``bytes_sent * count``."""
        return self.bytes_sent * self.count

    @property
    def origin(self) -> str:
        """Where it comes from (``ORIGINS``), read from the HLO metadata.

        "written": a collective the traced program calls (forward, or a hand-written backward);
        "transpose": autodiff's transpose of a collective, or of an explicit varying cast
        (``pcast`` / ``pvary``: Megatron f, ``data.vary``); "implicit": autodiff's transpose of a
        cast JAX inserted itself — ``check_vma``'s implicit broadcast of an invariant value into
        a varying computation, at ``source`` — usually a forgotten ``data.vary`` or sync axis.
        A transposed all-reduce whose source line is unknown counts as "transpose".
        """
        if "transpose(" not in self.op_name:
            return "written"
        if self.kind != "all-reduce" or not self.source:
            return "transpose"
        file, _, line = self.source.rpartition(":")
        text = linecache.getline(file, int(line)) if line.isdigit() else ""
        return "transpose" if not text or any(c in text for c in _CASTS) else "implicit"


ORIGINS = ("written", "transpose", "implicit")
_CASTS = ("pcast", "pvary")  # an explicit varying cast on the source line: intended transpose


NARROW_FLOATS = ("bf16", "f16")


@dataclasses.dataclass(frozen=True)
class Narrowing:
    """Collectives a compiler narrowed to a 16-bit float in a wider program (the TPU compiler
    moves the bf16 rounding of a default-precision matmul's operands before the collective
    that feeds it): how many, and the bytes per step they send fewer than written."""

    count: int = 0
    bytes_saved: float = 0.0


def widened(ledger: Ledger, dtype: str, written: Sequence[str] = ()) -> tuple[Ledger, Narrowing]:
    """``ledger`` with every 16-bit float collective of a program whose floats are ``dtype``
    (e.g. "f32") counted at that width (what the program wrote, so its contract applies), and
    what the narrowing saved; but the ``written`` kinds, which the program itself sends in
    16 bits (a bf16 gradient sync's all-reduces). A 16-bit program is returned as it is."""
    bits = {"f32": 32, "f64": 64}.get(dtype)
    if bits is None:
        return ledger, Narrowing()
    out, count, saved = [], 0, 0.0
    for c in ledger.collectives:
        narrow = [i for i, d in enumerate(c.dtypes) if d in NARROW_FLOATS]
        if not narrow or c.kind in written:
            out.append(c)
            continue
        wide = sum(
            hlo.leaf_bytes(dtype if i in narrow else d, shape)
            for i, (d, shape) in enumerate(zip(c.dtypes, c.shapes, strict=True))
        )
        scale = wide / c.result_bytes
        out.append(dataclasses.replace(c, result_bytes=wide, bytes_sent=c.bytes_sent * scale))
        count += c.count
        saved += c.total_bytes_sent * (scale - 1)
    return dataclasses.replace(ledger, collectives=tuple(out)), Narrowing(count, saved)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device buffer sizes in bytes, from ``compiled.memory_analysis()``."""

    argument: int
    output: int
    temp: int
    alias: int
    generated_code: int

    @property
    def peak(self) -> int:
        """Bytes the program holds at once: argument + output + temp − aliased."""
        return self.argument + self.output + self.temp - self.alias


@dataclasses.dataclass(frozen=True)
class Tally:
    """Executions per call and bytes sent per device, summed over a group of collectives."""

    count: int
    bytes_sent: float

    def add(self, c: Collective) -> Tally:
        return Tally(self.count + c.count, self.bytes_sent + c.total_bytes_sent)


@dataclasses.dataclass(frozen=True)
class Ledger:
    """The collectives, memory and flops of one compiled program (all per device).

    Attributes:
      collectives: one record per collective instruction, in HLO text order.
      hlo: the compiled HLO text that was parsed.
      memory: ``compiled.memory_analysis()``; None where the backend reports none.
      xla_flops: ``cost_analysis()["flops"]`` as XLA reports it: a while / scan body counted
        once, not once per iteration (a lower bound for scanned programs); None if unreported.
      matmuls: every dot and convolution that runs, with its FLOPs and count (``flops``).
    """

    collectives: tuple[Collective, ...]
    hlo: str = dataclasses.field(default="", repr=False)  # megabytes: print(ledger) shows the table
    memory: Memory | None = None
    xla_flops: float | None = None
    matmuls: tuple[Matmul, ...] = ()

    @property
    def flops(self) -> float:
        """Matmul FLOPs per device per call, read from the compiled program: every dot and
        convolution times its executions (loops by their trip counts, unlike ``xla_flops``)."""
        return sum(m.flops * m.count for m in self.matmuls)

    def __str__(self) -> str:
        return format_table(self)

    def total_bytes_sent(self) -> float:
        """Bytes one device sends in one call of the program, over every collective."""
        return sum(c.total_bytes_sent for c in self.collectives)

    def select(
        self, kind: str | None = None, axes: Iterable[str] | None = None
    ) -> list[Collective]:
        """The collectives of this ``kind`` (if given) spanning exactly ``axes`` (if given)."""
        want = None if axes is None else tuple(axes)
        return [
            c
            for c in self.collectives
            if (kind is None or c.kind == kind) and (want is None or c.axes == want)
        ]

    def implicit(self) -> list[Collective]:
        """The collectives autodiff inserted for ``check_vma``'s implicit casts (``origin``)."""
        return [c for c in self.collectives if c.origin == "implicit"]

    @property
    def overlapped_fraction(self) -> float:
        """The share of the bytes sent by collectives with a matmul scheduled between their
        start and done (``Collective.overlapped``); 0.0 when nothing is sent."""
        total = sum(c.total_bytes_sent for c in self.collectives)
        hidden = sum(c.total_bytes_sent for c in self.collectives if c.overlapped)
        return hidden / total if total else 0.0

    def summary(self) -> dict[tuple[str, tuple[str, ...]], Tally]:
        """(kind, axes) -> executions per call and bytes sent per device (bytes x count)."""
        out: dict[tuple[str, tuple[str, ...]], Tally] = {}
        for c in self.collectives:
            out[(c.kind, c.axes)] = out.get((c.kind, c.axes), Tally(0, 0.0)).add(c)
        return out

    def patterns(self) -> dict[tuple[str, tuple[str, ...]], dict[str, Tally]]:
        """(kind, axes) -> pattern -> executions and bytes: ``summary`` split by how the
        devices are linked (a bidirectional ring: half its bytes "shift +1", half "shift -1")."""
        out: dict[tuple[str, tuple[str, ...]], dict[str, Tally]] = {}
        for c in self.collectives:
            by = out.setdefault((c.kind, c.axes), {})
            by[c.pattern] = by.get(c.pattern, Tally(0, 0.0)).add(c)
        return out

    def to_json(self) -> dict[str, Any]:
        """The ``shardkit inspect --json`` fields: one entry per (kind, axes), bytes x count."""
        rows = [
            {"kind": kind, "axes": list(axes), "count": t.count, "bytes_sent": t.bytes_sent}
            for (kind, axes), t in self.summary().items()
        ]
        mem = self.memory
        return {
            "collectives": rows,
            "measured_bytes_sent": self.total_bytes_sent(),
            "flops": self.flops,
            "memory": {
                "argument": mem.argument if mem else None,
                "output": mem.output if mem else None,
                "temp": mem.temp if mem else None,
            },
        }


# --------------------------------------------------------------------------- measuring


def measure(
    fn: Callable[..., Any],
    *args: Any,
    mesh: AnyMesh | None = None,
    compiler_options: dict[str, str] | None = None,
    **kwargs: Any,
) -> Ledger:
    """Compiles ``fn`` for these arguments and returns its ledger.

    Args:
      fn: a ``jax.jit``-ed function, or a plain one (it is jitted here).
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``s), passed to ``lower``.
      **kwargs: example keyword arguments, passed to ``lower``.
      mesh: the mesh whose axes name the replica groups; default: the mesh of the first
        ``NamedSharding`` among the compiled program's input (then output) shardings. Without
        one, a program with collectives raises ``ValueError`` (see ``ledger_of``).
      compiler_options: XLA (and, compiling for a TPU, libtpu) options for this compile, e.g.
        ``run.target.TPU_FLAGS``'s; unknown names are the compiler's INVALID_ARGUMENT.

    Returns:
      A :class:`Ledger`; see the module docstring for what is counted and how.
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return ledger_of(jitted.lower(*args, **kwargs).compile(compiler_options), mesh)


def ledger_of(compiled: Any, mesh: AnyMesh | None = None) -> Ledger:
    """The ledger of an already compiled program (``jit(f).lower(...).compile()``); ``mesh`` as
    for ``measure``.

    Raises:
      ValueError: no ``mesh`` was given, none is found in the program's input or output
        shardings, and the program has collectives: their axes could not be named (they would
        all read "-" and rows of different axes would merge).
    """
    hlo = compiled.as_text()
    mesh = mesh if mesh is not None else _program_mesh(compiled)
    collectives = tuple(parse_hlo(hlo, mesh))
    if mesh is None and any(c.group_size > 1 for c in collectives):
        raise ValueError(
            "ledger.measure cannot name the mesh axes of this program's collectives: none of "
            "its inputs or outputs is placed with a NamedSharding; pass mesh=<the Mesh>."
        )
    found = tuple(parse_matmuls(hlo))
    return Ledger(collectives, hlo, _memory(compiled), _flops(compiled), found)


def _program_mesh(compiled: Any) -> Mesh | None:
    """The mesh of the first NamedSharding among the inputs, else among the outputs."""
    shardings = [*jax.tree.leaves(compiled.input_shardings)]
    shardings += jax.tree.leaves(compiled.output_shardings)
    for sharding in shardings:
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    return None


def _memory(compiled: Any) -> Memory | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return Memory(
        argument=int(stats.argument_size_in_bytes),
        output=int(stats.output_size_in_bytes),
        temp=int(stats.temp_size_in_bytes),
        alias=int(stats.alias_size_in_bytes),
        generated_code=int(stats.generated_code_size_in_bytes),
    )


def _flops(compiled: Any) -> float | None:
    costs = compiled.cost_analysis()
    if isinstance(costs, list | tuple):  # older JAX: one dict per program
        costs = costs[0] if costs else None
    if not costs or "flops" not in costs:
        return None
    return float(costs["flops"])


def format_table(ledger: Ledger) -> str:
    """A plain-text table (also ``str(ledger)``): one row per (kind, axes, group size, origin),
    then totals and memory. Collectives over groups of one device (a size-1 axis) send nothing:
    they are counted on one line, not listed."""
    rows: dict[tuple[str, tuple[str, ...], int, str], Tally] = {}
    alone = [c for c in ledger.collectives if c.group_size == 1]  # size-1 axes: nothing moves
    for c in ledger.collectives:
        if c.group_size == 1:
            continue
        key = (c.kind, c.axes, c.group_size, c.origin)
        rows[key] = rows.get(key, Tally(0, 0.0)).add(c)
    header = f"{'collective':<20}{'axes':<18}{'group':>6}{'count':>8}{'bytes sent':>16}  origin"
    lines = [header, "-" * len(header)]
    for (kind, axes, group, origin), t in sorted(rows.items()):
        axes_text = ",".join(axes) or "-"
        lines.append(
            f"{kind:<20}{axes_text:<18}{group:>6}{t.count:>8}{t.bytes_sent:>16,.0f}  {origin}"
        )
    total = ledger.total_bytes_sent()
    if alone:
        lines.append(
            f"({len(alone)} collectives over groups of one device: nothing sent, not listed)"
        )
    lines.append("-" * len(header))
    lines.append(f"{'total per device':<44}{sum(t.count for t in rows.values()):>8}{total:>16,.0f}")
    if ledger.memory is not None:
        m = ledger.memory
        lines.append(
            f"memory per device: argument {m.argument:,} B, output {m.output:,} B, "
            f"temp {m.temp:,} B, generated code {m.generated_code:,} B"
        )
    if ledger.xla_flops is not None:
        lines.append(f"XLA flops per device: {ledger.xla_flops:,.0f} (loop bodies counted once)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- parsing


@dataclasses.dataclass(frozen=True)
class _Context:
    mesh: AnyMesh | None
    num_devices: int | None
    frames: dict[int, str]


def parse_hlo(text: str, mesh: AnyMesh | None = None) -> list[Collective]:
    """Every collective in compiled HLO text, with its executions per call and bytes sent.

    Args:
      text: HLO module text, e.g. ``jax.jit(f).lower(*args).compile().as_text()``.
      mesh: the mesh the program was compiled over; names ``Collective.axes`` and gives the
        device count for ``replica_groups={}``.

    Returns:
      One :class:`Collective` per collective instruction that runs, in text order.
    """
    computations, entry = hlo.split_computations(text)
    runs = hlo.executions(computations, entry)
    num_devices = mesh.size if mesh is not None else hlo.header_devices(text)
    ctx = _Context(mesh, num_devices, hlo.stack_frames(text))
    roles = schedule.fused_roles(computations)  # the TPU compiler's async collective fusions
    overlap = schedule.Overlap(computations, roles)  # reads the program only where asked
    out = []
    for comp, instructions in computations.items():
        count, exact = runs.get(comp, (0, True))
        if roles.get(comp) in ("continue", "done"):
            continue  # copies of the collective its start fusion holds: recorded there
        for i, instr in enumerate(instructions if count else ()):
            kind = hlo.collective_kind(instr)
            if kind is None:
                continue
            c = _collective(instr, kind, comp, count, exact, ctx)
            if roles.get(comp) == "start":
                c = dataclasses.replace(c, overlapped=overlap.fused(comp))
            elif instr.opcode.endswith("-start"):
                c = dataclasses.replace(c, overlapped=overlap.pair(instructions[i + 1 :], instr))
            out.append(c)
    return out


def _collective(
    instr: hlo.Instruction, kind: str, comp: str, count: int, exact: bool, ctx: _Context
) -> Collective:
    leaves = hlo.leaves(hlo.result_shape(instr))
    permute = kind == "collective-permute"
    pairs = hlo.pairs(instr.attrs) if permute else ()
    groups = () if permute else hlo.replica_groups(instr.attrs, ctx.num_devices)
    if permute:  # the busiest device sends once per pair it is the source of
        size = hlo.linked_size(pairs)
        sends = max((sum(s == src for s, _ in pairs) for src, _ in pairs), default=0)
    else:
        size, sends = max((len(g) for g in groups), default=1), 0
    result_bytes = sum(hlo.leaf_bytes(dtype, dims) for dtype, dims in leaves)
    op_name, source = hlo.metadata(instr.attrs, ctx.frames)
    axes = _spanned_axes(groups or pairs, ctx.mesh)
    return Collective(
        kind=kind,
        group_size=size,
        axes=axes,
        shapes=tuple(dims for _, dims in leaves),
        dtypes=tuple(d for d, _ in leaves),
        result_bytes=result_bytes,
        bytes_sent=sent(kind, size, result_bytes, sends),
        count=count,
        name=instr.name,
        op_name=op_name,
        source=source,
        computation=comp,
        replica_groups=groups,
        source_target_pairs=pairs,
        pattern=pattern_of(groups, pairs, axes, ctx.mesh),
        count_exact=exact,
    )


GROUPS = "axis groups"


def shift(step: int, n: int | None = None) -> str:
    """The pattern of a cyclic shift by ``step`` over n devices: "shift +1", "shift -1", ...

    Normalised to (−n/2, n/2] when ``n`` is given: on two devices +1 and −1 are the same
    permutation ("shift +1").
    """
    k = step if n is None else step % n
    return f"shift {k if n is None or 2 * k <= n else k - n:+d}"


def exchange(distance: int, n: int) -> str:
    """Device i with i XOR ``distance`` (recursive halving): "xor 1", ...; at n/2 a shift."""
    return shift(distance, n) if 2 * distance == n else f"xor {distance}"


def spanning(by_key: dict[Any, Any]) -> dict[Any, Any]:
    """A ``summary()`` or ``patterns()`` without its one-device groups (an axis of size 1 that
    a spec names: nothing is sent); what contracts and reports compare."""
    return {key: value for key, value in by_key.items() if key[1]}


def shown_patterns(by: dict[str, Tally]) -> str:
    """The patterns of ``by`` other than plain axis groups, with their ops: ``shift +1 ×20,
    shift -1 ×20`` ("" when every op runs on its axes' groups)."""
    return ", ".join(f"{p} ×{t.count}" for p, t in sorted(by.items()) if p != GROUPS)


def pattern_of(
    groups: tuple[tuple[int, ...], ...],
    pairs: tuple[tuple[int, int], ...],
    axes: tuple[str, ...],
    mesh: AnyMesh | None,
) -> str:
    """How a collective's devices are linked (``Collective.pattern``), "" without a mesh.

    Pairs: the step from source to target in the linear index over ``axes`` (mesh order) of
    the two devices; one step for every pair is a shift, even if only some devices send (a
    pipeline's first stage receives nothing). Groups: ``GROUPS`` when they are the devices that
    share every coordinate but ``axes``.
    """
    if mesh is None or not axes:
        return ""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    where = [mesh.axis_names.index(a) for a in axes]
    n = math.prod(sizes[a] for a in axes)

    def linear(device: int) -> int:
        coord = np.unravel_index(device, mesh.axis_sizes)
        return int(np.ravel_multi_index([coord[w] for w in where], [sizes[a] for a in axes]))

    if pairs:
        steps = {(linear(t) - linear(s)) % n for s, t in pairs}
        if len(steps) == 1:
            return shift(steps.pop(), n)
        flips = {linear(t) ^ linear(s) for s, t in pairs}
        if len(flips) == 1:
            return exchange(flips.pop(), n)
        return "pairs " + " ".join(f"{s}>{t}" for s, t in sorted(pairs))
    partition = np.arange(mesh.size).reshape(mesh.axis_sizes)
    rest = [i for i in range(len(sizes)) if i not in where]
    want = {frozenset(g) for g in partition.transpose(rest + where).reshape(-1, n).tolist()}
    if {frozenset(g) for g in groups} == want:
        return GROUPS
    return "groups " + " ".join("{" + ",".join(map(str, g)) + "}" for g in groups)


def _spanned_axes(groups: Iterable[Iterable[int]], mesh: AnyMesh | None) -> tuple[str, ...]:
    """Mesh axes along which the devices within some group differ, in mesh order."""
    if mesh is None:
        return ()
    varying: set[int] = set()
    for group in groups:
        ids = list(group)
        if max(ids, default=0) >= mesh.size:
            raise ValueError(f"HLO names device {max(ids)} but the mesh has {mesh.size} devices.")
        coords = np.unravel_index(ids, mesh.axis_sizes)
        varying |= {a for a, c in enumerate(coords) if len(set(c.tolist())) > 1}
    return tuple(mesh.axis_names[a] for a in sorted(varying))
