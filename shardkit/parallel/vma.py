"""shard_map typing, the one copy: which mesh axes a value varies over, casting it to vary over
more, and the error a primitive raises when it runs outside ``jax.shard_map``.

Under ``check_vma=True`` a value is *varying* over mesh axis X when devices along X may hold
different values and *invariant* when they provably hold the same. Collectives, scan carries and
``lax.cond`` branches demand matching types, so a constant (a zeros buffer, a loop carry) must
often be cast to vary like the values merged into it. ``pcast(x, axes, to="varying")`` is the
identity forward; its transpose is a ``psum`` over ``axes``: the backward all-reduce that
Megatron's f, ``data.vary`` and every gradient sync rely on. Every cast in ``shardkit.parallel``
goes through :func:`vary`, so that the ledger's "written" origin (a ``pcast`` on the source
line) stays honest.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jax

Axis = str | tuple[str, ...]
F = TypeVar("F", bound=Callable[..., Any])


def names(axis: Axis | Iterable[str]) -> tuple[str, ...]:
    """``"model"`` -> ("model",); a tuple or any iterable of names -> a tuple of them."""
    return (axis,) if isinstance(axis, str) else tuple(axis)


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The mesh axes ``x`` is typed varying over (inside ``shard_map``)."""
    return frozenset(jax.typeof(x).mat.varying)


def tree_varying_axes(tree: Any) -> frozenset[str]:
    """The union of ``varying_axes`` over the leaves of ``tree``."""
    return frozenset().union(*(varying_axes(leaf) for leaf in jax.tree.leaves(tree)))


def vary(x: jax.Array, axes: Axis | Iterable[str]) -> jax.Array:
    """``x`` typed varying over every axis of ``axes`` (those it already varies over are
    left alone; no cast at all when none is missing). Identity forward, ``psum`` backward."""
    have = varying_axes(x)
    missing = tuple(sorted({a for a in names(axes) if a not in have}))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_like(x: jax.Array, *like: Any) -> jax.Array:
    """``x`` typed varying over every axis some leaf of ``like`` varies over (None skipped).

    A scan carry must keep its type: one that starts as a constant (zeros) must already vary
    like the values the loop body merges into it.
    """
    return vary(x, tree_varying_axes([y for y in like if y is not None]))


def vary_tree(tree: Any, axes: Axis | Iterable[str]) -> Any:
    """:func:`vary` on every leaf of ``tree``."""
    axes = names(axes)
    return jax.tree.map(lambda x: vary(x, axes), tree)


# ------------------------------------------------------------------ block boundaries


class UnreducedError(ValueError):
    """A block returned a value varying over a mesh axis its input was invariant over."""


def checked_block(fn: F) -> F:
    """Decorates a residual block ``fn(x, *rest) -> x'`` (or ``(x', aux)``, a scan body) so
    that an output varying over a mesh axis the input ``x`` is invariant over raises
    ``UnreducedError`` naming ``fn`` and the axis, at trace time.

    That is the type of a row-parallel partial sum left unreduced (``x + y`` with ``y`` never
    passed through ``tensor.exit_tp``): without the check it surfaces one block later, as
    JAX's scan-carry type error (whose hint, a cast on the carry, would hide the bug), or not
    at all in an unrolled loop, summed n times over the axis by the loss. A block's output
    must vary exactly like its input, so the check costs nothing and misses nothing of this
    kind.
    """

    @functools.wraps(fn)
    def block(x: jax.Array, *args: Any, **kwargs: Any) -> Any:
        out = fn(x, *args, **kwargs)
        y = out[0] if isinstance(out, tuple) else out
        extra = sorted(varying_axes(y) - varying_axes(x))
        if extra:
            axes = ", ".join(repr(a) for a in extra)
            raise UnreducedError(
                f"{getattr(fn, '__qualname__', fn)} returns a value varying over {axes} from "
                f"an input invariant over it: a partial sum left unreduced (end each "
                f"row-parallel region with tensor.exit_tp / dense_row, or psum over {axes})."
            )
        return out

    return block  # type: ignore[return-value]


# ------------------------------------------------------------------ outside shard_map


class OutsideShardMapError(ValueError):
    """A ``shard_map`` primitive called outside ``jax.shard_map``, or naming an axis that the
    mesh it runs on lacks. The message names the primitive (the outermost one called)."""

    def __init__(self, fn: Callable[..., Any], detail: str) -> None:
        self.detail = detail
        super().__init__(
            f"shardkit.{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__} must run inside "
            f"jax.shard_map, on a mesh that has every axis it is given ({detail})."
        )


# What JAX says when a collective runs with no shard_map around it, or with an unknown axis.
_OUTSIDE = ("unbound axis name", "should be called under jax.shard_map")
_AXIS_PARAMS = ("axis", "ulysses_axis", "ring_axis")


def shard_map_primitive(fn: F) -> F:
    """Decorates a primitive so that calling it outside ``shard_map`` (or naming an axis the
    mesh lacks) raises ``OutsideShardMapError`` naming it, instead of JAX's internal message.
    Only the error path is checked, so the primitives still work wherever JAX's collectives do
    (e.g. under ``vmap`` with an ``axis_name``)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OutsideShardMapError as err:
            raise OutsideShardMapError(fn, err.detail) from None
        except (NameError, ValueError, AssertionError) as err:
            detail = _outside_detail(err, signature.bind_partial(*args, **kwargs).arguments)
            if detail is None:
                raise
            raise OutsideShardMapError(fn, detail) from err

    return checked  # type: ignore[return-value]


def _outside_detail(err: Exception, arguments: dict[str, Any]) -> str | None:
    """Why ``err`` means "not inside a shard_map that has these axes", or None."""
    first = (str(err).splitlines() or [""])[0]
    if any(s in first for s in _OUTSIDE):
        return first
    mesh_axes = jax.sharding.get_abstract_mesh().axis_names
    named: list[Axis] = [arguments[p] for p in _AXIS_PARAMS if arguments.get(p) is not None]
    missing = [a for axis in named for a in names(axis) if mesh_axes and a not in mesh_axes]
    if isinstance(err, AssertionError) and missing:
        return f"the mesh has no axis {missing[0]!r}; its axes are {', '.join(mesh_axes)}"
    return None
