"""The HLO text parser: computations, instructions, call counts, device groups and shapes.

Model-free and collective-free: ``comm.ledger`` builds its records from what this module reads.

- ``split_computations(text)``: computation name -> its instructions (name, shape, opcode,
  attributes), and the ENTRY computation.
- ``executions(computations, entry)``: runs of each computation per call of the program,
  following ``calls=``, ``to_apply=``, ``body=``, ``condition=`` and branch computations; a
  ``while`` body runs its ``known_trip_count`` times (its condition once more); without one
  (the TPU compiler drops it), the count is read from the loop itself when it is a counted
  loop (``loop_trip_count``: ``i < N`` on a tuple element that starts at a constant and steps
  by 1); a loop of any other form counts once and is marked inexact.
- ``replica_groups`` (every printed spelling: explicit lists, ``{}``, iota ``[4,2]<=[8]``,
  transposed iota, ``mesh[...]{axes}`` with sub-axes), ``pairs`` (``source_target_pairs``),
  ``linked_size``.
- ``result_shape`` (async starts carry operands too), ``leaves``, ``leaf_bytes``, ``metadata``
  (op_name and ``file:line``, from metadata or the module's stack-frame tables).
- ``parse_matmuls``: every dot and convolution that runs, its FLOPs (``matmul_flops``) and
  its executions.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
ASYNC_STARTS = {f"{kind}-start": kind for kind in KINDS}
_NAMES_BY_BITS = {
    0: "token", 2: "s2 u2", 4: "s4 u4", 8: "pred s8 u8", 16: "s16 u16 f16 bf16",
    32: "s32 u32 f32", 64: "s64 u64 f64 c64", 128: "c128",
}  # fmt: skip
_DTYPE_BITS = {name: bits for bits, names in _NAMES_BY_BITS.items() for name in names.split()}


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    attrs: str
    operands: str = ""  # the text between the opcode's parentheses


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def split_computations(text: str) -> tuple[dict[str, list[Instruction]], str | None]:
    """Computation name -> its instructions, and the name of the ENTRY computation."""
    computations: dict[str, list[Instruction]] = {}
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


def _parse_instruction(line: str) -> Instruction | None:
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
    operands = rest[op.end() : end]
    return Instruction(match.group(1), shape, op.group(1), rest[end + 1 :], operands)


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


def header_devices(text: str) -> int | None:
    partitions = re.search(r"\bnum_partitions=(\d+)", text)
    replicas = re.search(r"\breplica_count=(\d+)", text)
    if partitions is None and replicas is None:
        return None
    return int(partitions.group(1) if partitions else 1) * int(replicas.group(1) if replicas else 1)


def stack_frames(text: str) -> dict[int, str]:
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


def _callees(instr: Instruction, trips: int | None = None) -> list[tuple[str, int, bool]]:
    """(computation, runs per run of ``instr``, whether that number is known) per callee;
    ``trips``: a ``while``'s trip count when its attributes do not say it."""
    if instr.opcode.endswith(("-update", "-done")):  # the start already called it
        return []
    known = _TRIP_COUNT.search(instr.attrs) if instr.opcode == "while" else None
    trips = int(known.group(1)) if known else trips
    out = []
    for key, value in _CALL.findall(instr.attrs):
        for callee in re.findall(r"%?([\w.\-]+)", value.strip("{}")):
            if instr.opcode == "while" and key in ("body", "condition"):
                runs = trips + (key == "condition") if trips is not None else 1
                out.append((callee, runs, trips is not None))
            else:
                out.append((callee, 1, True))
    return out


def _int_constant(instr: Instruction | None) -> int | None:
    if instr is None or instr.opcode != "constant" or not re.match(r"[su]\d+\[\]", instr.shape):
        return None
    return int(instr.operands) if re.fullmatch(r"-?\d+", instr.operands.strip()) else None


def _tuple_index(instr: Instruction | None) -> int | None:
    """k for ``get-tuple-element(param), index=k``, else None."""
    if instr is None or instr.opcode != "get-tuple-element":
        return None
    found = re.search(r"index=(\d+)", instr.attrs)
    return int(found.group(1)) if found else None


def _callee(instr: Instruction, key: str) -> str | None:
    found = re.search(rf"(?<![\w]){key}=%?([\w.\-]+)", instr.attrs)
    return found.group(1) if found else None


def loop_trip_count(
    loop: Instruction, caller: list[Instruction], computations: dict[str, list[Instruction]]
) -> int | None:
    """The trip count of a counted ``while`` (the form ``lax.scan`` / ``fori_loop`` lower to):
    its condition is ``element k < N`` (constant N), element k of its initial tuple is a
    constant c, and its body returns ``element k + 1``: N − c. None for any other form."""
    cond = {i.name: i for i in computations.get(_callee(loop, "condition") or "", [])}
    body = computations.get(_callee(loop, "body") or "", [])
    for compare in cond.values():
        names = operand_names(compare)
        if compare.opcode != "compare" or "direction=LT" not in compare.attrs or len(names) != 2:
            continue
        k, bound = _tuple_index(cond.get(names[0])), _int_constant(cond.get(names[1]))
        if k is None or bound is None:
            continue
        start = _initial_element(loop, caller, k)
        if start is not None and _steps_by_one(body, k) and bound > start:
            return bound - start
    return None


def _initial_element(loop: Instruction, caller: list[Instruction], k: int) -> int | None:
    by_name = {i.name: i for i in caller}
    init = by_name.get(next(iter(operand_names(loop)), ""))
    if init is None or init.opcode != "tuple":
        return None
    names = operand_names(init)
    value = by_name.get(names[k]) if k < len(names) else None
    return _int_constant(_uncopied(value, by_name))  # the TPU compiler copies the start


def _steps_by_one(body: list[Instruction], k: int) -> bool:
    """Whether the body's result tuple holds ``element k + 1`` at index k."""
    by_name = {i.name: i for i in body}
    tuples = [i for i in body if i.opcode == "tuple"]
    names = operand_names(tuples[-1]) if tuples else []  # the ROOT tuple comes last
    step = by_name.get(names[k]) if k < len(names) else None
    if step is None or step.opcode != "add" or len(operand_names(step)) != 2:
        return False
    a, b = (_uncopied(by_name.get(n), by_name) for n in operand_names(step))
    return any(_tuple_index(x) == k and _int_constant(y) == 1 for x, y in ((a, b), (b, a)))


def _uncopied(value: Instruction | None, by_name: dict[str, Instruction]) -> Instruction | None:
    """``value`` past any ``copy`` (the TPU compiler copies loop counters into other memory)."""
    while value is not None and value.opcode == "copy":
        value = by_name.get(next(iter(operand_names(value)), ""))
    return value


def executions(
    computations: dict[str, list[Instruction]], entry: str | None
) -> dict[str, tuple[int, bool]]:
    """Computation -> (runs per call of the program, exact?), following the call graph."""
    callers: dict[str, list[tuple[str, int, bool]]] = {}
    for comp, instructions in computations.items():
        for instr in instructions:
            trips = None
            if instr.opcode == "while" and not _TRIP_COUNT.search(instr.attrs):
                trips = loop_trip_count(instr, instructions, computations)
            for callee, runs, exact in _callees(instr, trips):
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


def result_shape(instr: Instruction) -> str:
    """The shape of the collective's result; an async start's shape carries its operands too.

    ``all-reduce-start`` returns its result; ``all-gather-start`` returns (operands...,
    results...); ``collective-permute-start`` and the generic async starts
    (``reduce-scatter-start``, ``all-to-all-start``) return (operands, result, context...).
    """
    tuple_start = instr.opcode in ASYNC_STARTS and instr.shape.startswith("(")
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


def leaves(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a (possibly nested tuple) HLO shape."""
    out = []
    for dtype, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]", shape):
        sizes = [d.strip().removeprefix("<=") for d in dims.split(",") if d.strip()]
        out.append((dtype, tuple(int(s) for s in sizes)))
    return out


def leaf_bytes(dtype: str, dims: tuple[int, ...]) -> int:
    bits = _DTYPE_BITS.get(dtype)
    if bits is None and dtype[:2] in ("f8", "f4"):  # the many fp8 / fp4 spellings
        bits = int(dtype[1])
    if bits is None:
        raise ValueError(f"Unknown HLO element type {dtype!r}; cannot size the collective.")
    return (bits * math.prod(dims) + 7) // 8


def metadata(attrs: str, frames: dict[int, str]) -> tuple[str, str]:
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


def pairs(attrs: str) -> tuple[tuple[int, int], ...]:
    """``source_target_pairs={{0,1},{1,2}}``, minus pairs from a device to itself."""
    match = re.search(r"(?<![\w])source_target_pairs=", attrs)
    if match is None:
        return ()
    body = attrs[match.end() : _closing(attrs, match.end()) + 1]
    pairs = re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", body)
    return tuple((int(s), int(t)) for s, t in pairs if s != t)


def replica_groups(attrs: str, num_devices: int | None) -> tuple[tuple[int, ...], ...]:
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


def linked_size(pairs: tuple[tuple[int, int], ...]) -> int:
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


MATMULS = ("dot", "convolution")


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One ``dot`` or ``convolution`` of a compiled program (``matmul_flops``).

    flops: per execution, per device; count: executions per call (``executions``: loops by
    their trip counts, every branch of a conditional as if it ran); op_name: the JAX op that
    produced it (its named scopes, e.g. a pipeline branch's).
    """

    name: str
    op_name: str
    flops: float
    count: int
    count_exact: bool = True


def parse_matmuls(text: str) -> list[Matmul]:
    """Every dot and convolution in compiled HLO text that runs, with its FLOPs and count."""
    computations, entry = split_computations(text)
    runs = executions(computations, entry)
    frames = stack_frames(text)
    out = []
    for comp, instructions in computations.items():
        count, exact = runs.get(comp, (0, True))
        shapes = {i.name: i.shape for i in instructions}
        for instr in instructions if count else ():
            flops = matmul_flops(instr, shapes)
            if flops is not None:
                op_name, _ = metadata(instr.attrs, frames)
                out.append(Matmul(instr.name, op_name, flops, count, exact))
    return out


def matmul_flops(instr: Instruction, shapes: dict[str, str]) -> float | None:
    """FLOPs of one execution of a ``dot`` (2 · result elements · contracted elements) or a
    ``convolution`` (2 · result elements · kernel elements per output feature); None for any
    other instruction. ``shapes``: instruction name -> shape, in ``instr``'s computation (the
    compiled text names operands without their shapes)."""
    if instr.opcode not in MATMULS:
        return None
    (_, out), *_ = leaves(result_shape(instr))
    names = operand_names(instr)
    found_shapes = [leaves(shapes[n])[0][1] for n in names[:2] if n in shapes]
    if len(found_shapes) < 2:
        return None
    lhs, rhs = found_shapes
    if instr.opcode == "dot":
        found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
        dims = [int(d) for d in found.group(1).split(",") if d] if found else []
        return 2.0 * math.prod(out) * math.prod(lhs[d] for d in dims)
    return 2.0 * _convolution_macs(instr.attrs, lhs, rhs, out)


def _convolution_macs(attrs: str, lhs: tuple[int, ...], rhs: tuple[int, ...],
                      out: tuple[int, ...]) -> float:  # fmt: skip
    """Multiply-adds of one ``convolution`` that touch a real input: output batch × output
    features × the kernel's input features × per spatial dimension the (output, window)
    position pairs that land on an input element, not on padding or a dilation hole. The TPU
    compiler writes batched matmuls as convolutions whose windows span the batch dimensions
    with ``lhs_dilate`` = window (one pair per output position); counting the whole window
    there would count those matmuls batch-fold."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs)
    if labels is None:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    macs = float(out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")])
    window = _window(attrs)
    for d in range(sum(c.isdigit() for c in lhs_l)):
        field = {k: v[d] for k, v in window.items()}
        macs *= _pairs(lhs[lhs_l.index(str(d))], rhs[rhs_l.index(str(d))],
                       out[out_l.index(str(d))], field)  # fmt: skip
    return macs


def _window(attrs: str) -> dict[str, list[tuple[int, ...]]]:
    """A convolution's ``window={...}`` fields, per spatial dimension (pads as (lo, hi))."""
    found = re.search(r"window=\{([^}]*)\}", attrs)
    fields: dict[str, list[tuple[int, ...]]] = {}
    for item in found.group(1).split() if found else ():
        key, _, value = item.partition("=")
        parts = value.split("x")
        fields[key] = [tuple(int(n) for n in p.split("_")) for p in parts]
    return fields


def _pairs(size: int, kernel: int, outputs: int, window: dict[str, tuple[int, ...]]) -> int:
    """(output, window) position pairs of one spatial dimension that read an input element."""
    stride = window.get("stride", (1,))[0]
    pad_lo = window.get("pad", (0, 0))[0]
    lhs_dilate = window.get("lhs_dilate", (1,))[0]
    rhs_dilate = window.get("rhs_dilate", (1,))[0]
    last = (size - 1) * lhs_dilate
    count = 0
    for k in range(kernel):
        shift = k * rhs_dilate - pad_lo  # pos = o * stride + shift
        if lhs_dilate == 1:  # every o with 0 <= pos <= last
            lo, hi = max(0, -(shift // stride)), min(outputs - 1, (last - shift) // stride)
            count += max(0, hi - lo + 1)
        else:
            count += sum(0 <= o * stride + shift <= last and (o * stride + shift) % lhs_dilate == 0
                         for o in range(outputs))  # fmt: skip
    return count


def calls_any(instr: Instruction, comps: set[str]) -> bool:
    """Whether ``instr`` calls one of ``comps`` (``calls=``, ``body=``, ...)."""
    return any(callee in comps for callee, _, _ in _callees(instr))


def operand_names(instr: Instruction) -> list[str]:
    """The instruction names ``instr`` reads."""
    return re.findall(r"%([\w.\-]+)", instr.operands)


def collective_kind(instr: Instruction) -> str | None:
    """The collective an instruction runs, if any; un-sugared async wrappers run none."""
    if instr.opcode in KINDS:
        return instr.opcode
    if instr.opcode in ASYNC_STARTS and not re.search(r"(?<![\w])calls=", instr.attrs):
        return ASYNC_STARTS[instr.opcode]
    return None
