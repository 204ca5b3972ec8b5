"""Rematerialisation of a model's blocks: what the backward recomputes instead of keeping.

  POLICIES   ``"none"`` keeps every residual; ``"dots"`` keeps the matmul outputs and
             recomputes the elementwise work (norms, activations, softmax); ``"full"`` keeps
             only each block's input and re-runs the whole block in the backward
  block      a decorator for a residual block (a ``lax.scan`` body or a loop's step): checked
             by ``vma.checked_block`` and wrapped in ``jax.checkpoint`` with the policy in
             force where it is traced
  policy     a context manager setting that policy; ``ShardedModel(remat=...)`` enters it
             around the user's ``loss_local``, so the plan, not the model code, decides

The values are the same under every policy; only the temporaries and the backward's work
differ. A collective inside a block re-runs with it where its output is not kept ("full", and
"dots" for every collective, since only matmul outputs are saveable): the step then sends
more than the no-remat contract states.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax

from shardkit.parallel.vma import checked_block

POLICIES: dict[str, Any] = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}
_POLICY: contextvars.ContextVar[str] = contextvars.ContextVar("remat", default="none")
F = TypeVar("F", bound=Callable[..., Any])


def check(name: str) -> str:
    """``name`` if it is a policy; ValueError naming the choices otherwise."""
    if name not in POLICIES:
        raise ValueError(f"Unknown remat policy {name!r}; choose {', '.join(POLICIES)}.")
    return name


@contextlib.contextmanager
def policy(name: str) -> Iterator[None]:
    """The policy ``block`` applies to the blocks traced inside this context."""
    token = _POLICY.set(check(name))
    try:
        yield
    finally:
        _POLICY.reset(token)


def current() -> str:
    """The policy in force (``"none"`` outside any ``policy`` context)."""
    return _POLICY.get()


def block(fn: F) -> F:
    """``fn`` checked like ``vma.checked_block`` and, unless the policy in force when it is
    called is ``"none"``, run under ``jax.checkpoint`` with that policy."""
    checked = checked_block(fn)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        name = current()
        if name == "none":
            return checked(*args, **kwargs)
        return jax.checkpoint(checked, policy=POLICIES[name])(*args, **kwargs)

    return run  # type: ignore[return-value]
