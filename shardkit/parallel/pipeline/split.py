"""A chunk's backward cut in two for zero-bubble schedules: B (input gradient) and W (weights).

``SplitBackward(bwd, *args)`` traces ``bwd(*args) -> (d_params, dx)`` (a chunk's vjp applied to
its output cotangent) to a jaxpr and partitions its equations:

  B  every equation ``dx`` depends on (the backward slice of ``dx``);
  W  every other equation ``d_params`` depends on.

``input_grad(*args) -> (dx, cut)`` runs B and returns the *cut*: the values B computed that W
reads (the cotangents at each weight's use, e.g. ∂L/∂h of ``h = x @ W``), which the engine
stashes; ``weight_grad(*args, cut) -> d_params`` runs W from the same args and the cut. Nothing
is computed twice: each equation runs in exactly one of the two (a test counts the matmuls).

A ``scan`` (a chunk's layers, scanned) is split too, recursively: B scans the carries that ``dx``
needs (the input-gradient chain) and stacks its body's cut as extra outputs; W scans the rest
(the stacked weight gradients, the accumulated ones in its own carries) over those stacks. Calls
(``pjit``, ``closed_call``, ``remat``) are inlined first, so their equations split as any other.
Any other equation with a sub-program (a ``cond``, a ``while``, a ``custom_vjp`` or a Pallas
kernel) is indivisible: it runs in B when ``dx`` needs any of its outputs.

Why: ZB-H1 (Qi et al. 2023) defers W to fill the pipeline's bubbles; B must not redo W's work,
nor W redo B's (running the whole vjp in W re-runs the input-gradient chain: one more
backward's worth of matmuls per microbatch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax
from jax.extend import core

_CALLS = {"pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call"}


@dataclasses.dataclass(frozen=True)
class _ScanSplit:
    """How one scan equation splits: its body's partition and which carries B runs."""

    body: _Partition
    b_carry: tuple[int, ...]  # carry positions computed in B
    b_ys: tuple[int, ...]  # ys positions computed in B (the rest: W)
    b_reads: tuple[int, ...]  # operand positions B reads (consts, carry inits, xs)
    w_reads: tuple[int, ...]  # operand positions W reads


@dataclasses.dataclass(frozen=True)
class _Partition:
    """One jaxpr's equations as B, W (indices), the scans split between both, and the cut:
    keys of the values B defines that W reads (a Var, or (eqn, j) for a split scan's j-th
    stacked body cut)."""

    jaxpr: core.Jaxpr
    consts: tuple[Any, ...]
    b_eqns: frozenset[int]
    w_eqns: frozenset[int]
    scans: dict[int, _ScanSplit]
    cut: tuple[Hashable, ...]
    b_reads: frozenset[Any]  # invars B reads
    w_reads: frozenset[Any]  # invars W reads


class SplitBackward:
    """``bwd(*args) -> (d_params, dx)`` as B (``input_grad``) and W (``weight_grad``).

    ``args``: example arguments (arrays or tracers) of the types the calls will pass.
    """

    def __init__(self, bwd: Callable[..., tuple[Any, jax.Array]], *args: Any) -> None:
        inlined, out_shape = jax.make_jaxpr(_inlined(bwd), return_shape=True)(*args)
        dp_shape, dx_shape = out_shape
        self._dp_tree, self._dx_tree = jax.tree.structure(dp_shape), jax.tree.structure(dx_shape)
        n_out = len(inlined.jaxpr.outvars)
        dx_leaves = len(jax.tree.leaves(dx_shape))
        self._dx = tuple(range(n_out - dx_leaves, n_out))
        self._part = _partition(inlined.jaxpr, tuple(inlined.consts), frozenset(self._dx), ())

    def input_grad(self, *args: Any) -> tuple[jax.Array, list[jax.Array]]:
        """B: (dx, cut)."""
        env = _seeded(self._part, jax.tree.leaves(args))
        _run(self._part, env, "b")
        dx = [_read(env, self._part.jaxpr.outvars[i]) for i in self._dx]
        cut = [env[k] for k in self._part.cut]
        return jax.tree.unflatten(self._dx_tree, dx), cut

    def weight_grad(self, *args: Any, cut: list[jax.Array]) -> Any:
        """W: d_params, from the same args and B's cut."""
        env = _seeded(self._part, jax.tree.leaves(args))
        env.update(zip(self._part.cut, cut, strict=True))
        _run(self._part, env, "w")
        outs = self._part.jaxpr.outvars
        dp = [_read(env, v) for i, v in enumerate(outs) if i not in self._dx]
        return jax.tree.unflatten(self._dp_tree, dp)


# ----------------------------------------------------------------------------- inlining


def _inlined(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose trace has its calls inlined, also inside scan bodies."""

    def run(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat = _eval_inlined(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), flat)

    return run


def _eval_inlined(jaxpr: core.Jaxpr, consts: Any, args: list[Any]) -> list[Any]:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        ins = [_read(env, v) for v in eqn.invars]
        if eqn.primitive.name in _CALLS:
            sub = eqn.params.get("jaxpr") or eqn.params["call_jaxpr"]
            sub_consts = getattr(sub, "consts", ())
            outs = _eval_inlined(getattr(sub, "jaxpr", sub), sub_consts, ins)
        elif eqn.primitive.name == "scan":
            outs = _rescan(eqn, ins)
        else:
            outs = _bind(eqn, ins)
        _write(env, eqn.outvars, outs)
    return [_read(env, v) for v in jaxpr.outvars]


def _rescan(eqn: Any, ins: list[Any]) -> list[Any]:
    """The scan ``eqn`` re-run by ``lax.scan``, its body's calls inlined."""
    p = eqn.params
    nc, ncar, body = p["num_consts"], p["num_carry"], p["jaxpr"]
    consts, init, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]

    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = _eval_inlined(body.jaxpr, body.consts, [*consts, *carry, *x])
        return outs[:ncar], outs[ncar:]

    carry, ys = jax.lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"],
                             unroll=p["unroll"])  # fmt: skip
    return [*carry, *ys]


# ----------------------------------------------------------------------------- partition


def _partition(
    jaxpr: core.Jaxpr, consts: tuple[Any, ...], b_outs: frozenset[int], not_in_w: tuple[Any, ...]
) -> _Partition:
    """B computes outvars ``b_outs``, W every other; ``not_in_w``: invars W cannot read
    directly (a scan's B carries), so they join the cut when W reads them."""
    eqns = jaxpr.eqns
    need_b = {v for i, v in enumerate(jaxpr.outvars) if i in b_outs and _is_var(v)}
    b_eqns: set[int] = set()
    scans: dict[int, _ScanSplit] = {}
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        wanted = tuple(k for k, v in enumerate(eqn.outvars) if v in need_b)
        if not wanted:
            continue
        b_eqns.add(i)
        split = _split_scan(eqn, wanted) if eqn.primitive.name == "scan" else None
        if split is None:
            need_b |= {v for v in eqn.invars if _is_var(v)}
        else:
            scans[i] = split
            need_b |= {eqn.invars[k] for k in split.b_reads if _is_var(eqn.invars[k])}
    b_defined = {v for i in b_eqns for v in _b_outputs(eqns[i], scans.get(i))}
    cut_vars = b_defined | set(not_in_w)
    reads_w: set[Any] = {v for i, v in enumerate(jaxpr.outvars) if i not in b_outs and _is_var(v)}
    w_eqns: set[int] = set()
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        if i in b_eqns and i not in scans:
            continue
        outs = eqn.outvars
        if i in scans:  # W runs the outputs B did not
            outs = [v for v in outs if v not in b_defined]
        if not any(v in reads_w and v not in cut_vars for v in outs):
            continue
        w_eqns.add(i)
        operands = scans[i].w_reads if i in scans else range(len(eqn.invars))
        reads_w |= {eqn.invars[k] for k in operands if _is_var(eqn.invars[k])}
    cut: list[Hashable] = [v for v in _ordered(jaxpr, cut_vars) if v in reads_w]
    for i in sorted(scans):
        if i in w_eqns:
            cut += [(i, j) for j in range(len(scans[i].body.cut))]
    invars = set(jaxpr.invars)
    return _Partition(
        jaxpr, consts, frozenset(b_eqns), frozenset(w_eqns), scans, tuple(cut),
        frozenset(need_b & invars), frozenset(reads_w & invars),
    )  # fmt: skip


def _split_scan(eqn: Any, wanted: tuple[int, ...]) -> _ScanSplit | None:
    """The split of a scan whose outputs ``wanted`` B needs, or None if B needs all of it."""
    p = eqn.params
    nc, ncar, body = p["num_consts"], p["num_carry"], p["jaxpr"]
    n_out = len(body.jaxpr.outvars)
    b_carry = {k for k in wanted if k < ncar}
    while True:  # B's carries are closed: a B carry's update reads only B carries
        b_outs = frozenset(b_carry | {k for k in wanted if k >= ncar})
        ins = body.jaxpr.invars
        carry_in = [ins[nc + k] for k in sorted(b_carry)]
        part = _partition(body.jaxpr, tuple(body.consts), b_outs, tuple(carry_in))
        more = {k for k in range(ncar) if ins[nc + k] in part.b_reads} - b_carry
        if not more:
            break
        b_carry |= more
    if len(b_outs) == n_out:
        return None
    ins = body.jaxpr.invars

    def carry(k: int, which: set[int]) -> bool:  # operand k initialises one of ``which``
        return nc <= k < nc + ncar and k - nc in which

    w_carry = set(range(ncar)) - b_carry
    return _ScanSplit(
        part,
        tuple(sorted(b_carry)),
        tuple(k - ncar for k in sorted(b_outs) if k >= ncar),
        tuple(k for k, v in enumerate(ins) if v in part.b_reads or carry(k, b_carry)),
        tuple(k for k, v in enumerate(ins) if v in part.w_reads or carry(k, w_carry)),
    )


def _b_outputs(eqn: Any, split: _ScanSplit | None) -> list[Any]:
    if split is None:
        return [v for v in eqn.outvars if _is_var(v)]
    ncar = eqn.params["num_carry"]
    return [eqn.outvars[k] for k in split.b_carry] + [eqn.outvars[ncar + k] for k in split.b_ys]


def _ordered(jaxpr: core.Jaxpr, keys: set[Any]) -> list[Any]:
    """``keys`` in a fixed order: invars, then each equation's outputs."""
    everything = [*jaxpr.invars, *(v for e in jaxpr.eqns for v in e.outvars)]
    return [v for v in everything if v in keys]


# ----------------------------------------------------------------------------- evaluation


def _seeded(part: _Partition, args: list[Any]) -> dict[Any, Any]:
    env: dict[Any, Any] = dict(zip(part.jaxpr.constvars, part.consts, strict=True))
    env.update(zip(part.jaxpr.invars, args, strict=True))
    return env


def _run(part: _Partition, env: dict[Any, Any], which: str) -> None:
    """Evaluates ``part``'s B (``which="b"``) or W equations into ``env``."""
    mine = part.b_eqns if which == "b" else part.w_eqns
    for i, eqn in enumerate(part.jaxpr.eqns):
        if i not in mine:
            continue
        if i in part.scans:
            (_scan_b if which == "b" else _scan_w)(eqn, part.scans[i], env, i)
        else:
            _write(env, eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars]))


def _scan_b(eqn: Any, split: _ScanSplit, env: dict[Any, Any], index: int) -> None:
    """B's scan: its carries, its ys, and the body's cut stacked (env[(index, j)])."""
    p, body = eqn.params, split.body
    nc, ncar = p["num_consts"], p["num_carry"]
    operands = {k: _read(env, eqn.invars[k]) for k in split.b_reads}
    init = [_read(env, eqn.invars[nc + k]) for k in split.b_carry]
    xs = {k: v for k, v in operands.items() if k >= nc + ncar}

    def step(carry: list[Any], x: dict[int, Any]) -> tuple[list[Any], tuple[list[Any], ...]]:
        inner: dict[Any, Any] = dict(zip(body.jaxpr.constvars, body.consts, strict=True))
        ins = body.jaxpr.invars
        inner.update({ins[k]: v for k, v in operands.items() if k < nc})
        inner.update({ins[nc + k]: c for k, c in zip(split.b_carry, carry, strict=True)})
        inner.update({ins[k]: v for k, v in x.items()})
        _run(body, inner, "b")
        outs = body.jaxpr.outvars
        new_carry = [_read(inner, outs[k]) for k in split.b_carry]
        ys = [_read(inner, outs[ncar + k]) for k in split.b_ys]
        return new_carry, (ys, [inner[k] for k in body.cut])

    carry, (ys, stacked) = jax.lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"])
    _write(env, [eqn.outvars[k] for k in split.b_carry], carry)
    _write(env, [eqn.outvars[ncar + k] for k in split.b_ys], ys)
    env.update({(index, j): v for j, v in enumerate(stacked)})


def _scan_w(eqn: Any, split: _ScanSplit, env: dict[Any, Any], index: int) -> None:
    """W's scan: the carries and ys B did not run, over the stacked cut."""
    p, body = eqn.params, split.body
    nc, ncar = p["num_consts"], p["num_carry"]
    w_carry = [k for k in range(ncar) if k not in split.b_carry]
    w_ys = [k for k in range(len(eqn.outvars) - ncar) if k not in split.b_ys]
    operands = {k: _read(env, eqn.invars[k]) for k in split.w_reads}
    init = [operands[nc + k] for k in w_carry]
    xs = {k: v for k, v in operands.items() if k >= nc + ncar}
    stacked = [env[(index, j)] for j in range(len(body.cut))]

    def step(carry: list[Any], x: tuple[dict[int, Any], list[Any]]) -> tuple[list[Any], list[Any]]:
        own, cut = x
        inner: dict[Any, Any] = dict(zip(body.jaxpr.constvars, body.consts, strict=True))
        ins = body.jaxpr.invars
        inner.update({ins[k]: v for k, v in operands.items() if k < nc})
        inner.update({ins[nc + k]: c for k, c in zip(w_carry, carry, strict=True)})
        inner.update({ins[k]: v for k, v in own.items()})
        inner.update(zip(body.cut, cut, strict=True))
        _run(body, inner, "w")
        outs = body.jaxpr.outvars
        return [_read(inner, outs[k]) for k in w_carry], [
            _read(inner, outs[ncar + k]) for k in w_ys
        ]

    carry, ys = jax.lax.scan(step, init, (xs, stacked), length=p["length"], reverse=p["reverse"])
    _write(env, [eqn.outvars[k] for k in w_carry], carry)
    _write(env, [eqn.outvars[ncar + k] for k in w_ys], ys)


# ----------------------------------------------------------------------------- helpers


def _is_var(v: Any) -> bool:
    return not isinstance(v, core.Literal)


def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if isinstance(v, core.Literal) else env[v]


def _write(env: dict[Any, Any], outvars: list[Any], values: list[Any]) -> None:
    for v, value in zip(outvars, values, strict=True):
        env[v] = value


def _bind(eqn: Any, ins: list[Any]) -> list[Any]:
    out = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]
