"""Which async collectives of a compiled program run beside a matmul (its schedule read).

``comm.ledger`` marks a collective ``overlapped`` when the program's scheduled order puts a
matmul between its start and its done: its transfer can hide behind that compute. Two async
forms appear in compiled HLO:

- start / done pairs (``all-gather-start`` … ``all-gather-done``, likewise for the other four
  kinds; XLA:CPU's and the TPU compiler's collective-permutes): ``Overlap.pair``.
- The TPU compiler's async collective fusions (libtpu's ``xla_tpu_enable_async_collective_
  fusion``, on by default): one collective split into a start fusion (its computation's root
  a ``custom-call`` to ``AsyncCollectiveStart``), fusions that carry it on beside compute
  (computations named ``async_collective_fusion…``) and a done fusion (``AsyncCollectiveDone``).
  Each of those computations holds a copy of the collective instruction, so a parser that
  counts collective instructions counts it once per piece. ``fused_roles`` names the pieces
  (the ledger records the collective at its start only) and ``Overlap.fused`` reads the
  overlap from the start fusion's caller: a matmul, or a continuing fusion with one inside,
  between the start and the done it feeds.
"""

from __future__ import annotations

import functools
import re

from shardkit.comm.hlo import MATMULS, Instruction, calls_any, operand_names

Computations = dict[str, list[Instruction]]
_FUSED_ENDS = {"AsyncCollectiveStart": "start", "AsyncCollectiveDone": "done"}
_CONTINUE_PREFIX = "async_collective_fusion"


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


class Overlap:
    """Whether each async collective of one program has a matmul scheduled before its done;
    what it needs of the whole program (the computations that run a matmul, the fused
    starts' callers) is found once, on first use."""

    def __init__(self, computations: Computations, roles: dict[str, str]) -> None:
        self.computations, self.roles = computations, roles

    @functools.cached_property
    def matmuls(self) -> set[str]:
        """Computations that run a matmul (``dot`` / ``convolution``), directly or through a
        fusion they call."""
        comps = self.computations
        found = {c for c, ins in comps.items() if any(i.opcode in MATMULS for i in ins)}
        grew = True
        while grew:
            grew = False
            for comp, instructions in comps.items():
                if comp not in found and any(calls_any(i, found) for i in instructions):
                    found.add(comp)
                    grew = True
        return found

    def pair(self, following: list[Instruction], start: Instruction) -> bool:
        """A start / done pair: whether a matmul is scheduled between ``start`` and its
        ``-done`` (``following``: the instructions after ``start`` in its computation's
        scheduled order). False for a synchronous collective."""
        if not start.opcode.endswith("-start"):
            return False
        for instr in following:
            if instr.opcode.endswith("-done") and start.name in operand_names(instr):
                return False
            if self._is_matmul(instr):
                return True
        return False

    def fused(self, start_comp: str) -> bool:
        """The async collective fusion started by ``start_comp``: whether a matmul, or a
        fusion calling one (a continuing fusion runs the collective beside its compute), is
        scheduled before its done, in the computation that calls the start."""
        return start_comp in self._fused_hidden

    @functools.cached_property
    def _fused_hidden(self) -> set[str]:
        """Every start computation whose fusion has a matmul before its done."""
        starts = {c for c, role in self.roles.items() if role == "start"}
        dones = {c for c, role in self.roles.items() if role == "done"}
        hidden = set()
        for instructions in self.computations.values():
            for i, instr in enumerate(instructions):
                if instr.opcode != "fusion" or not calls_any(instr, starts):
                    continue
                if self._before_done(instructions[i + 1 :], instr, dones):
                    hidden |= {c for c in starts if calls_any(instr, {c})}
        return hidden

    def _before_done(
        self, following: list[Instruction], start: Instruction, dones: set[str]
    ) -> bool:
        """A matmul in ``following`` before the done fusion that reads what ``start`` made
        (through get-tuple-elements and continuing fusions)."""
        reached = {start.name}
        for instr in following:
            reads = bool(reached.intersection(operand_names(instr)))
            if reads and calls_any(instr, dones):
                return False
            if self._is_matmul(instr):
                return True
            if reads:
                reached.add(instr.name)
        return False

    def _is_matmul(self, instr: Instruction) -> bool:
        return instr.opcode in MATMULS or calls_any(instr, self.matmuls)
