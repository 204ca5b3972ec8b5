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
  there is recorded. A combined op (all-reduce or all-to-all with a tuple result)
  is one record whose bytes are the sum over the tuple.

How often: ``count``, executions per call of the program
  The call graph is followed from ``ENTRY`` through ``calls=``, ``to_apply=``, ``body=``,
  ``condition=`` and the branch computations. A ``while`` body runs its ``known_trip_count``
  times (its condition once more), so a collective in a ``lax.scan`` of length L counts L and
  nested loops multiply. A loop without a known trip count is counted as running once and its
  collectives get ``count_exact=False``. Every branch of a ``conditional`` is counted as if it
  ran. Computations that ``ENTRY`` never reaches run 0 times and contribute no records.

Bytes sent per device per execution: ``bytes_sent`` (ring algorithms, DESIGN.md)
  all-reduce of V bytes            2(n-1)/n * V
  all-gather producing V bytes     (n-1)/n * V
  reduce-scatter of an input of V  (n-1)/n * V     (V = result bytes * n)
  all-to-all of V local bytes      (n-1)/n * V
  collective-permute of V bytes    V
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

Memory and flops (per device, as XLA reports them)
  ``Ledger.memory`` is ``compiled.memory_analysis()``. ``Ledger.xla_flops`` is
  ``compiled.cost_analysis()["flops"]`` recorded as-is and NOT corrected: XLA counts a
  ``while`` / ``lax.scan`` body once, whatever its trip count, so for scanned layers it is a
  lower bound (about one layer's flops, not L layers').
"""

from __future__ import annotations

import dataclasses
import itertools
import linecache
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_ASYNC_STARTS = {f"{kind}-start": kind for kind in KINDS}
_NAMES_BY_BITS = {
    0: "token", 2: "s2 u2", 4: "s4 u4", 8: "pred s8 u8", 16: "s16 u16 f16 bf16",
    32: "s32 u32 f32", 64: "s64 u64 f64 c64", 128: "c128",
}  # fmt: skip
_DTYPE_BITS = {name: bits for bits, names in _NAMES_BY_BITS.items() for name in names.split()}

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
        "shift -1") when every pair sends from linear index i to i + k mod n over ``axes``;
        else the explicit groups or pairs. "" without a mesh.
      count_exact: False when an enclosing loop has no known trip count (``count`` then counts
        that loop once).
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


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device buffer sizes in bytes, from ``compiled.memory_analysis()``."""

    argument: int
    output: int
    temp: int
    alias: int
    generated_code: int


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
    """

    collectives: tuple[Collective, ...]
    hlo: str = ""
    memory: Memory | None = None
    xla_flops: float | None = None

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
            "memory": {
                "argument": mem.argument if mem else None,
                "output": mem.output if mem else None,
                "temp": mem.temp if mem else None,
            },
        }


# --------------------------------------------------------------------------- measuring


def measure(
    fn: Callable[..., Any], *args: Any, mesh: AnyMesh | None = None, **kwargs: Any
) -> Ledger:
    """Compiles ``fn`` for these arguments and returns its ledger.

    Args:
      fn: a ``jax.jit``-ed function, or a plain one (it is jitted here).
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``s), passed to ``lower``.
      **kwargs: example keyword arguments, passed to ``lower``.
      mesh: the mesh whose axes name the replica groups; default: the mesh of the first
        ``NamedSharding`` among the compiled program's input (then output) shardings. Without
        one, a program with collectives raises ``ValueError`` (see ``ledger_of``).

    Returns:
      A :class:`Ledger`; see the module docstring for what is counted and how.
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return ledger_of(jitted.lower(*args, **kwargs).compile(), mesh)


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
    return Ledger(collectives, hlo, _memory(compiled), _flops(compiled))


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
    """A plain-text table: one row per (kind, axes, group size, origin), then totals and memory."""
    rows: dict[tuple[str, tuple[str, ...], int, str], Tally] = {}
    for c in ledger.collectives:
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
class _Instruction:
    name: str
    shape: str
    opcode: str
    attrs: str


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
    computations, entry = _split_computations(text)
    runs = _executions(computations, entry)
    num_devices = mesh.size if mesh is not None else _header_devices(text)
    ctx = _Context(mesh, num_devices, _stack_frames(text))
    out = []
    for comp, instructions in computations.items():
        count, exact = runs.get(comp, (0, True))
        for instr in instructions if count else ():
            kind = _kind(instr)
            if kind is not None:
                out.append(_collective(instr, kind, comp, count, exact, ctx))
    return out


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def _split_computations(text: str) -> tuple[dict[str, list[_Instruction]], str | None]:
    """Computation name -> its instructions, and the name of the ENTRY computation."""
    computations: dict[str, list[_Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is not None:
            if line.strip().startswith("}"):  # also `}, execution_thread="..."`
                current = None
            elif (instr := _parse_instruction(line)) is not None:
                computations[current].append(instr)
            continue
        header = _HEADER.match(line)
        if header and not line.startswith("HloModule"):
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
    return computations, entry


def _parse_instruction(line: str) -> _Instruction | None:
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    rest = match.group(2)
    if rest.startswith("("):  # tuple shape
        end = _closing(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :]
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"\s*([\w\-]+)\(", rest)
    if op is None:
        return None
    end = _closing(rest, op.end() - 1)
    return _Instruction(match.group(1), shape, op.group(1), rest[end + 1 :])


def _closing(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``text[start]`` (quoted strings skipped)."""
    open_, close = text[start], {"(": ")", "[": "]", "{": "}"}[text[start]]
    depth, quoted = 0, False
    for i in range(start, len(text)):
        ch = text[i]
        if ch == '"' and text[i - 1] != "\\":
            quoted = not quoted
        elif not quoted and ch == open_:
            depth += 1
        elif not quoted and ch == close:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"Unbalanced {open_!r} in HLO text: {text[start : start + 80]!r}")


def _header_devices(text: str) -> int | None:
    partitions = re.search(r"\bnum_partitions=(\d+)", text)
    replicas = re.search(r"\breplica_count=(\d+)", text)
    if partitions is None and replicas is None:
        return None
    return int(partitions.group(1) if partitions else 1) * int(replicas.group(1) if replicas else 1)


def _stack_frames(text: str) -> dict[int, str]:
    """``stack_frame_id`` -> ``file:line`` from the module's FileNames/.../StackFrames tables."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            tables[section] = {}
        elif not line.strip():
            section = None
        elif section is not None and (row := re.match(r"(\d+) (.*)$", line)):
            tables[section][int(row.group(1))] = row.group(2)
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    locations = {}
    for k, v in tables.get("FileLocations", {}).items():
        loc = re.search(r"file_name_id=(\d+).*?\bline=(\d+)", v)
        if loc:
            locations[k] = f"{files.get(int(loc.group(1)), '?')}:{loc.group(2)}"
    frames = {}
    for k, v in tables.get("StackFrames", {}).items():
        frame = re.search(r"file_location_id=(\d+)", v)
        if frame and int(frame.group(1)) in locations:
            frames[k] = locations[int(frame.group(1))]
    return frames


# --------------------------------------------------------------------------- call graph

_CALL = re.compile(
    r"(?<![\w])(calls|to_apply|body|condition|true_computation|false_computation|"
    r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def _callees(instr: _Instruction) -> list[tuple[str, int, bool]]:
    """(computation, runs per run of ``instr``, whether that number is known) per callee."""
    if instr.opcode.endswith(("-update", "-done")):  # the start already called it
        return []
    trip = _TRIP_COUNT.search(instr.attrs) if instr.opcode == "while" else None
    out = []
    for key, value in _CALL.findall(instr.attrs):
        for callee in re.findall(r"%?([\w.\-]+)", value.strip("{}")):
            if instr.opcode == "while" and key in ("body", "condition"):
                runs = int(trip.group(1)) + (key == "condition") if trip else 1
                out.append((callee, runs, trip is not None))
            else:
                out.append((callee, 1, True))
    return out


def _executions(
    computations: dict[str, list[_Instruction]], entry: str | None
) -> dict[str, tuple[int, bool]]:
    """Computation -> (runs per call of the program, exact?), following the call graph."""
    callers: dict[str, list[tuple[str, int, bool]]] = {}
    for comp, instructions in computations.items():
        for instr in instructions:
            for callee, runs, exact in _callees(instr):
                callers.setdefault(callee, []).append((comp, runs, exact))
    roots = {entry} if entry else {c for c in computations if c not in callers}
    memo: dict[str, tuple[int, bool]] = {}

    def visit(comp: str, path: frozenset[str]) -> tuple[int, bool]:
        if comp in path:
            raise ValueError(f"HLO call graph has a cycle through {comp!r}.")
        if comp in roots:
            return (1, True)
        if comp not in memo:
            total, exact = 0, True
            for caller, runs, known in callers.get(comp, []):
                n, ok = visit(caller, path | {comp})
                total, exact = total + n * runs, exact and ok and known
            memo[comp] = (total, exact)
        return memo[comp]

    return {comp: visit(comp, frozenset()) for comp in computations}


# --------------------------------------------------------------------------- one collective


def _kind(instr: _Instruction) -> str | None:
    """The collective an instruction runs, if any; un-sugared async wrappers run none."""
    if instr.opcode in KINDS:
        return instr.opcode
    if instr.opcode in _ASYNC_STARTS and not re.search(r"(?<![\w])calls=", instr.attrs):
        return _ASYNC_STARTS[instr.opcode]
    return None


def _collective(
    instr: _Instruction, kind: str, comp: str, count: int, exact: bool, ctx: _Context
) -> Collective:
    leaves = _leaves(_result_shape(instr))
    permute = kind == "collective-permute"
    pairs = _pairs(instr.attrs) if permute else ()
    groups = () if permute else _replica_groups(instr.attrs, ctx.num_devices)
    if permute:  # the busiest device sends once per pair it is the source of
        size = _linked_size(pairs)
        sends = max((sum(s == src for s, _ in pairs) for src, _ in pairs), default=0)
    else:
        size, sends = max((len(g) for g in groups), default=1), 0
    result_bytes = sum(_leaf_bytes(dtype, dims) for dtype, dims in leaves)
    op_name, source = _metadata(instr.attrs, ctx.frames)
    axes = _spanned_axes(groups or pairs, ctx.mesh)
    return Collective(
        kind=kind,
        group_size=size,
        axes=axes,
        shapes=tuple(dims for _, dims in leaves),
        dtypes=tuple(d for d, _ in leaves),
        result_bytes=result_bytes,
        bytes_sent=_bytes_sent(kind, size, result_bytes, sends),
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


def _bytes_sent(kind: str, n: int, result_bytes: int, sends: int) -> float:
    """Ring-model bytes one device sends per execution (the table in the module docstring)."""
    if kind == "collective-permute":
        return float(result_bytes * sends)
    if kind == "all-reduce":
        return 2 * (n - 1) / n * result_bytes
    if kind == "reduce-scatter":  # the input is n results
        return (n - 1) / n * (result_bytes * n)
    return (n - 1) / n * result_bytes  # all-gather (of its output), all-to-all


def _result_shape(instr: _Instruction) -> str:
    """The shape of the collective's result; an async start's shape carries its operands too.

    ``all-reduce-start`` returns its result; ``all-gather-start`` returns (operands...,
    results...); ``collective-permute-start`` and the generic async starts
    (``reduce-scatter-start``, ``all-to-all-start``) return (operands, result, context...).
    """
    tuple_start = instr.opcode in _ASYNC_STARTS and instr.shape.startswith("(")
    if not tuple_start or instr.opcode == "all-reduce-start":
        return instr.shape
    parts = _tuple_elements(instr.shape)
    if instr.opcode == "all-gather-start":
        return ", ".join(parts[len(parts) // 2 :])
    return parts[1]


def _tuple_elements(shape: str) -> list[str]:
    inner = re.sub(r"/\*.*?\*/", "", shape.strip())[1:-1]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    return [*parts, inner[start:].strip()] if inner.strip() else parts


def _leaves(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a (possibly nested tuple) HLO shape."""
    out = []
    for dtype, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]", shape):
        sizes = [d.strip().removeprefix("<=") for d in dims.split(",") if d.strip()]
        out.append((dtype, tuple(int(s) for s in sizes)))
    return out


def _leaf_bytes(dtype: str, dims: tuple[int, ...]) -> int:
    bits = _DTYPE_BITS.get(dtype)
    if bits is None and dtype[:2] in ("f8", "f4"):  # the many fp8 / fp4 spellings
        bits = int(dtype[1])
    if bits is None:
        raise ValueError(f"Unknown HLO element type {dtype!r}; cannot size the collective.")
    return (bits * math.prod(dims) + 7) // 8


def _metadata(attrs: str, frames: dict[int, str]) -> tuple[str, str]:
    """(op_name, ``file:line``) from ``metadata={...}``; "" where absent."""
    op_name = re.search(r'\bop_name="((?:[^"\\]|\\.)*)"', attrs)
    file = re.search(r'\bsource_file="((?:[^"\\]|\\.)*)"', attrs)
    line = re.search(r"\bsource_line=(\d+)", attrs)
    frame = re.search(r"\bstack_frame_id=(\d+)", attrs)
    if file:
        source = f"{file.group(1)}:{line.group(1) if line else '?'}"
    else:
        source = frames.get(int(frame.group(1)), "") if frame else ""
    return (op_name.group(1) if op_name else ""), source


# --------------------------------------------------------------------------- device groups


def _pairs(attrs: str) -> tuple[tuple[int, int], ...]:
    """``source_target_pairs={{0,1},{1,2}}``, minus pairs from a device to itself."""
    match = re.search(r"(?<![\w])source_target_pairs=", attrs)
    if match is None:
        return ()
    body = attrs[match.end() : _closing(attrs, match.end()) + 1]
    pairs = re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", body)
    return tuple((int(s), int(t)) for s, t in pairs if s != t)


def _replica_groups(attrs: str, num_devices: int | None) -> tuple[tuple[int, ...], ...]:
    """The replica groups in any printed spelling; ``{}`` or none means all devices."""
    match = re.search(r"(?<![\w])replica_groups=", attrs)
    value = attrs[match.end() :] if match else "{}"
    if value.startswith("{"):
        body = value[1 : _closing(value, 0)]
        rows = re.findall(r"\{([^{}]*)\}", body)
        groups = [[int(i) for i in re.findall(r"\d+", row)] for row in rows]
    elif value.startswith("["):
        groups = _iota(value).tolist()
    elif value.startswith("mesh"):
        groups = _mesh_axes_groups(value)
    else:
        raise ValueError(f"Unrecognised replica_groups spelling: {value[:80]!r}")
    if not groups:
        if num_devices is None:
            raise ValueError("replica_groups={} means all devices: pass mesh= to count them.")
        groups = [list(range(num_devices))]
    return tuple(tuple(g) for g in groups)


_IOTA = re.compile(r"\[([\d,\s]*)\]\s*<=\s*\[([\d,\s]*)\](?:\s*T\(([\d,\s]*)\))?")


def _iota(spec: str) -> np.ndarray:
    """``[dims]<=[reshape]T(perm)``: iota over prod(reshape), reshaped, transposed, reshaped."""
    match = _IOTA.match(spec)
    if match is None:
        raise ValueError(f"Unrecognised iota device list: {spec[:80]!r}")
    dims, reshape, perm = (
        [int(v) for v in g.split(",") if v.strip()] if g else [] for g in match.groups()
    )
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return (ids.transpose(perm) if perm else ids).reshape(dims)


_MESH_GROUPS = re.compile(
    r"mesh\[([^\]]*)\](?:\s*,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?\s*\{([^}]*)\}"
)


def _mesh_axes_groups(spec: str) -> list[list[int]]:
    """``mesh['a'=4,'b'=2] {'b'}``: devices that share every coordinate but the listed axes.

    A listed sub-axis ``'a':(p)k`` is the k-sized piece of ``a`` with p-sized pieces on its
    major side, as in Shardy.
    """
    match = _MESH_GROUPS.match(spec)
    if match is None:
        raise ValueError(f"Unrecognised mesh replica groups: {spec[:80]!r}")
    axes = [(n, int(s)) for n, s in re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", match.group(1))]
    total = math.prod(s for _, s in axes)
    ids = _device_ids(match.group(2), total)
    refs = []
    for name, pre, sub in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", match.group(3)):
        size = dict(axes)[name]
        refs.append((name, int(pre) if pre else 1, int(sub) if sub else size))
    dims: list[int] = []
    grouped: list[int] = []
    for name, size in axes:
        cuts = sorted({1, size} | {c for n, p, k in refs if n == name for c in (p, p * k)})
        for lo, hi in itertools.pairwise(cuts):
            if any(n == name and p <= lo < p * k for n, p, k in refs):
                grouped.append(len(dims))
            dims.append(hi // lo)
    rest = [d for d in range(len(dims)) if d not in grouped]
    per_group = math.prod(dims[d] for d in grouped)
    return ids.reshape(dims).transpose(rest + grouped).reshape(-1, per_group).tolist()


def _device_ids(spec: str | None, total: int) -> np.ndarray:
    """A mesh's ``device_ids=(...)``: iota form or a list of ids; absent means iota."""
    if not spec:
        return np.arange(total)
    if "<=" in spec:
        return _iota(spec.strip()).reshape(-1)
    transposed = _TRANSPOSED_IOTA.fullmatch(spec.strip())
    if transposed:  # "[2,4]T(1,0)": iota over [2, 4], transposed, flattened
        dims, perm = ([int(v) for v in g.split(",") if v.strip()] for g in transposed.groups())
        return np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(-1)
    return np.array([int(i) for i in re.findall(r"\d+", spec)[-total:]])


_TRANSPOSED_IOTA = re.compile(r"\[([\d,\s]*)\]\s*T\(([\d,\s]*)\)")


def _linked_size(pairs: tuple[tuple[int, int], ...]) -> int:
    """Size of the largest set of devices connected by source/target pairs."""
    parent: dict[int, int] = {}

    def root(i: int) -> int:
        while parent.setdefault(i, i) != i:
            i = parent[i]
        return i

    for s, t in pairs:
        parent[root(s)] = root(t)
    sizes: dict[int, int] = {}
    for i in parent:
        sizes[root(i)] = sizes.get(root(i), 0) + 1
    return max(sizes.values(), default=1)


GROUPS = "axis groups"


def shift(step: int, n: int | None = None) -> str:
    """The pattern of a cyclic shift by ``step`` over n devices: "shift +1", "shift -1", ...

    Normalised to (−n/2, n/2] when ``n`` is given: on two devices +1 and −1 are the same
    permutation ("shift +1").
    """
    k = step if n is None else step % n
    return f"shift {k if n is None or 2 * k <= n else k - n:+d}"


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
        return "pairs " + " ".join(f"{s}>{t}" for s, t in pairs)
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
