"""The ring model, written once: bytes one device SENDS per execution of each collective.

DESIGN.md's table, for n devices and V the bytes named:

  all-reduce of V bytes            2(n−1)/n · V     (reduce-scatter + all-gather)
  all-gather producing V bytes     (n−1)/n · V
  reduce-scatter of an input of V  (n−1)/n · V
  all-to-all of V local bytes      (n−1)/n · V
  collective-permute of V bytes    V

The ledger prices every measured op with :func:`sent`; every expectation (a model's cost
terms, ``contract.all_reduce`` and friends) with the named functions. Both go through these
five formulas, so measured and expected can only differ in what moves, never in arithmetic.
"""

from __future__ import annotations


def all_reduce_bytes(v: float, n: int) -> float:
    """AllReduce of V bytes over n devices (reduce-scatter + all-gather): 2(n−1)/n · V."""
    return 2 * (n - 1) / n * v


def all_gather_bytes(v: float, n: int) -> float:
    """AllGather producing V bytes over n devices: (n−1)/n · V."""
    return (n - 1) / n * v


def reduce_scatter_bytes(v: float, n: int) -> float:
    """ReduceScatter of an input of V bytes over n devices: (n−1)/n · V."""
    return (n - 1) / n * v


def all_to_all_bytes(v: float, n: int) -> float:
    """AllToAll of V local bytes over n devices (each keeps 1/n): (n−1)/n · V."""
    return (n - 1) / n * v


def permute_bytes(v: float) -> float:
    """CollectivePermute of V bytes: every device sends its whole block once: V."""
    return float(v)


def sent(kind: str, n: int, result_bytes: int, sends: int = 1) -> float:
    """Bytes one device sends in one execution of a measured op of ``kind`` over ``n`` devices
    whose result is ``result_bytes``; a permute's busiest device sends once per pair it is the
    source of (``sends``)."""
    if kind == "collective-permute":
        return permute_bytes(result_bytes * sends)
    if kind == "all-reduce":
        return all_reduce_bytes(result_bytes, n)
    if kind == "reduce-scatter":  # the input is n results
        return reduce_scatter_bytes(result_bytes * n, n)
    if kind == "all-gather":
        return all_gather_bytes(result_bytes, n)
    return all_to_all_bytes(result_bytes, n)
