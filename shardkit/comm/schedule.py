"""Which async collectives of a compiled program run beside a matmul (its schedule read).

``comm.ledger`` marks a collective ``overlapped`` when the program's scheduled order puts a
matmul between its start and its done: its transfer can hide behind that compute. Two async
forms appear in compiled HLO:

- start / done pairs (``all-gather-start`` … ``all-gather-done``, likewise for the other four
  kinds; XLA:CPU's and the TPU compiler's collective-permutes): ``overlaps_matmul``.
- The TPU compiler's async collective fusions (libtpu's ``xla_tpu_enable_async_collective_
  fusion``, on by default): one collective split into a start fusion (its computation's root
  a ``custom-call`` to ``AsyncCollectiveStart``), fusions that carry it on beside compute
  (computations named ``async_collective_fusion…``) and a done fusion (``AsyncCollectiveDone``).
  Each of those computations holds a copy of the collective instruction, so a parser that
  counts collective instructions counts it once per piece. ``fused_roles`` names the pieces
  (the ledger records the collective at its start only) and ``fused_overlaps`` reads the
  overlap from the start fusion's caller: a matmul, or a continuing fusion with one inside,
  between the start and the done it feeds.
"""

from __future__ import annotations

import re

from shardkit.comm.hlo import MATMULS, Instruction, calls_any, operand_names

Computations = dict[str, list[Instruction]]
_FUSED_ENDS = {"AsyncCollectiveStart": "start", "AsyncCollectiveDone": "done"}
_CONTINUE_PREFIX = "async_collective_fusion"


def matmul_computations(computations: Computations) -> set[str]:
    """Computations that run a matmul (``dot`` / ``convolution``), directly or through a
    fusion they call."""
    found = {c for c, ins in computations.items() if any(i.opcode in MATMULS for i in ins)}
    grew = True
    while grew:
        grew = False
        for comp, instructions in computations.items():
            if comp not in found and any(calls_any(i, found) for i in instructions):
                found.add(comp)
                grew = True
    return found


def overlaps_matmul(following: list[Instruction], start: Instruction, matmuls: set[str]) -> bool:
    """Whether a matmul is scheduled between an async ``start`` and its ``-done``:
    ``following`` are the instructions after ``start`` in its computation's scheduled order;
    ``matmuls`` is ``matmul_computations``. False for a synchronous collective."""
    if not start.opcode.endswith("-start"):
        return False
    for instr in following:
        if instr.opcode.endswith("-done") and start.name in operand_names(instr):
            return False
        if instr.opcode in MATMULS or calls_any(instr, matmuls):
            return True
    return False


def fused_roles(computations: Computations) -> dict[str, str]:
    """Computation -> "start", "continue" or "done" for the pieces of the TPU compiler's
    async collective fusions (module docstring); other computations are absent."""
    roles = {}
    for comp, instructions in computations.items():
        for instr in instructions:
            target = re.search(r'custom_call_target="(\w+)"', instr.attrs)
            if instr.opcode == "custom-call" and target and target.group(1) in _FUSED_ENDS:
                roles[comp] = _FUSED_ENDS[target.group(1)]
        if comp.startswith(_CONTINUE_PREFIX) and comp not in roles:
            roles[comp] = "continue"
    return roles


def fused_overlaps(
    computations: Computations, start_comp: str, roles: dict[str, str], matmuls: set[str]
) -> bool:
    """Whether the async collective fusion started by ``start_comp`` has a matmul scheduled
    before its done, in the computation that calls the start: a matmul instruction, or a
    fusion calling one (a continuing fusion runs the collective beside its compute)."""
    dones = {c for c, role in roles.items() if role == "done"}
    for instructions in computations.values():
        for i, instr in enumerate(instructions):
            if instr.opcode == "fusion" and calls_any(instr, {start_comp}):
                return _matmul_before_done(instructions[i + 1 :], instr, dones, matmuls)
    return False


def _matmul_before_done(
    following: list[Instruction], start: Instruction, dones: set[str], matmuls: set[str]
) -> bool:
    """A matmul in ``following`` before the done fusion that reads what ``start`` made
    (through get-tuple-elements and continuing fusions)."""
    reached = {start.name}
    for instr in following:
        reads = bool(reached.intersection(operand_names(instr)))
        if reads and calls_any(instr, dones):
            return False
        if instr.opcode in MATMULS or calls_any(instr, matmuls):
            return True
        if reads:
            reached.add(instr.name)
    return False
