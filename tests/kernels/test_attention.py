"""The Pallas attention kernels (splash, in Pallas' interpreter on CPU) equal the jnp path.

Masks first (NumPy only): every hop mask ``hop_masks`` derives from a layout's positions is the
causal mask of those positions, pair by pair, and the rectangles a several-run mask runs as
cover it exactly once. Then each sequence mode on the Pallas kernel
against the same mode on jnp, float32, ≤ 1e-5 relative: out, lse and dq, dk, dv under a loss
that also reads lse, with grouped-query heads, padding (num_valid and token counts that are
not multiples of 128), key masks and packed segments; and the same bytes on the wire.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardkit import kernels
from shardkit.comm.ledger import measure
from shardkit.kernels import attention as attention_lib
from shardkit.mesh import make_mesh
from shardkit.parallel.sequence import attention_local, layouts, sharded_attention
from shardkit.testing import max_error

TOL = 1e-5


@given(
    layout=st.sampled_from(layouts.LAYOUTS),
    n=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2]),
    per_shard=st.sampled_from([2, 4, 6]),
)
def test_hop_masks_are_the_causal_masks_of_the_positions(layout, n, group, per_shard) -> None:
    table = layouts.positions(layout, n * group, per_shard).reshape(n, group * per_shard)
    masks, case = kernels.hop_masks(table)
    t = table.shape[1]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    for me in range(n):
        for src in range(n):
            want = table[me][:, None] >= table[src][None, :]
            np.testing.assert_array_equal(masks[case[me, src]].visible(i, j), want)
    assert len(masks) <= 3  # a handful of kernels per layout, whatever n
    for mask in masks:  # several runs: rectangles under one run's mask cover it exactly
        if mask.runs == 1 or mask.empty or mask.full:
            continue
        covered = np.zeros((t, t), int)
        for rows, cols, piece in attention_lib._pieces(mask):
            assert piece.runs == 1 and not piece.empty
            r, c = np.arange(rows.stop - rows.start), np.arange(cols.stop - cols.start)
            covered[rows, cols] += piece.visible(r[:, None], c[None, :])
        np.testing.assert_array_equal(covered, mask.visible(i, j))
        if layout == "zigzag" and group == 1:  # a ring's hop: 1 or 2 rectangles
            assert attention_lib._by_pieces(mask) and len(attention_lib._pieces(mask)) <= 2


def test_positions_without_even_runs_are_refused() -> None:
    shuffled = np.random.default_rng(0).permutation(64)[None, :]
    with pytest.raises(ValueError, match="runs of evenly spaced positions"):
        kernels.hop_masks(shuffled)


def test_kernel_names(monkeypatch) -> None:
    assert kernels.resolve_kernel("auto", 4096) == "jnp"  # CPU
    assert kernels.resolve_kernel("pallas", 16) == "pallas"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # auto on a TPU: by length
    assert kernels.resolve_kernel("auto", 512) == "jnp"
    assert kernels.resolve_kernel("auto", 1024) == kernels.resolve_kernel("auto") == "pallas"
    with pytest.raises(ValueError, match="kernel must be one of auto, jnp, pallas; got 'cuda'"):
        kernels.resolve_kernel("cuda")


def inputs(t: int, heads: int = 4, kv_heads: int = 2, batch: int = 2, d: int = 32) -> tuple:
    keys = jax.random.split(jax.random.key(t), 4)
    q = jax.random.normal(keys[0], (batch, t, heads, d))
    k, v = (jax.random.normal(key, (batch, t, kv_heads, d)) for key in keys[1:3])
    w = jax.random.normal(keys[3], q.shape)
    return q, k, v, w


def results(attend, q, k, v, w) -> tuple:
    """(out, lse, dq, dk, dv) of ``attend`` under a loss reading both out and lse."""

    def loss(q, k, v):
        out, lse = attend(q, k, v)
        return jnp.sum(out * w) + jnp.sum(jnp.tanh(lse)), (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return (out, lse, *grads)


def assert_kernels_agree(attend, *args) -> None:
    want = results(functools.partial(attend, kernel="jnp"), *args)
    got = results(functools.partial(attend, kernel="pallas"), *args)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert max_error(a, b) <= TOL, name


@pytest.mark.parametrize("causal", [False, True])
def test_local_attention(causal) -> None:
    """200 tokens (padded to 256 inside), GQA, a key mask and two packed segments."""
    q, k, v, w = inputs(200)
    key_valid = jnp.arange(200) < 190
    segs = jnp.broadcast_to((jnp.arange(200) >= 120).astype(jnp.int32), (2, 200))
    attend = functools.partial(
        lambda q, k, v, kernel: attention_local(
            q, k, v, key_valid, causal=causal, segment_ids=segs, kernel=kernel
        )
    )
    assert_kernels_agree(attend, q, k, v, w)


CASES = {
    "ring, bidirectional, key mask": dict(mode="ring", causal=False, mask=True),
    "ring, causal, contiguous": dict(mode="ring", causal=True),
    "ring, causal, zigzag, segments": dict(mode="ring", causal=True, layout="zigzag", segs=True),
    "ring, causal, striped": dict(mode="ring", causal=True, layout="striped"),
    "Ulysses, causal, zigzag": dict(mode="ulysses", causal=True, layout="zigzag"),
    "USP 2×2, causal, zigzag": dict(mode="usp", causal=True, layout="zigzag", ulysses=2),
}


@pytest.mark.parametrize("name", CASES)
def test_sequence_modes(name) -> None:
    """Four devices on seq, 4·128 − 40 tokens (the padding masked by num_valid)."""
    case = dict(CASES[name])
    t = 4 * 128 - 40
    q, k, v, w = inputs(t)
    key_valid = (jnp.arange(t) % 7 != 3)[None].repeat(2, 0) if case.pop("mask", False) else None
    segs = jnp.broadcast_to((jnp.arange(t) * 3 // t).astype(jnp.int32), (2, t))
    segs = segs if case.pop("segs", False) else None
    attend = functools.partial(
        sharded_attention, mesh=make_mesh({"seq": 4}, devices=jax.devices()[:4]),
        key_valid=key_valid, segment_ids=segs, **case,
    )  # fmt: skip
    assert_kernels_agree(attend, q, k, v, w)


@pytest.mark.parametrize("mode, extra", [("ring", {}), ("ulysses", {}), ("usp", {"ulysses": 2})])
def test_the_kernel_moves_no_bytes(mode, extra) -> None:
    """Each causal zigzag mode's step sends the same collectives on either kernel (kernels
    compute only): the contracts of every sequence mode hold unchanged."""
    q, k, v, _ = inputs(4 * 128)
    mesh = make_mesh({"seq": 4}, devices=jax.devices()[:4])

    def ledger(kernel: str):
        def loss(q, k, v):
            out, _ = sharded_attention(
                q, k, v, mesh, mode, causal=True, layout="zigzag", kernel=kernel, **extra
            )
            return out.sum()

        ledger = measure(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v)
        return sorted((c.kind, c.count, c.bytes_sent) for c in ledger.collectives)

    assert ledger("pallas") == ledger("jnp")
