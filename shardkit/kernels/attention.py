"""Block attention on JAX's Pallas splash-attention kernels (TPU; interpret mode elsewhere).

One block of queries q [b, t, h, d] against one block of keys and values k, v [b, s, h_kv, d]
(h_kv divides h: grouped-query heads share a key head without being repeated), under

- a static ``HopMask``: which (query, key) pairs are visible, in local indices, derived from
  the tokens' global positions (``hop_masks``): a ring hop of any layout is a few runs of
  evenly spaced positions, and its mask is, per pair of runs, everything, nothing, or a causal
  diagonal with an offset; the kernel skips the blocks a mask hides;
- dynamic segment ids (packed sequences) and a key mask (padding), both as splash's segment
  ids: a masked key gets a segment no query has.

``block_attention`` returns (out, lse) with float32 lse [b, h, t]; ``block_attention_grads``
takes a log-sum-exp and delta = rowsum(d_out · out) − d_lse computed over *every* block the
queries saw (a ring's whole sequence) and returns this block's float32 (dq, dk, dv): the
per-hop forward and backward of ``shardkit.parallel.sequence``. Rows with no visible key give
out 0 and lse ``MASK_VALUE``, as the jnp path does.

The backward calls splash's fused dq/dk/dv kernel (``_splash_attention_bwd_dkv``, private in
JAX 0.10.2, the version ``pyproject.toml`` pins): splash's public custom_vjp computes delta from
its own block's output, which a ring hop's backward must not. Tokens are padded to whole
blocks of 128 (the TPU's lanes) and the padding masked: any t, s works.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config as _jax_config  # the shard_map type check's switch (see _run)
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jaxtyping import Array

from shardkit.mesh import KERNELS

__all__ = [
    "KERNELS",
    "MASK_VALUE",
    "HopMask",
    "attend",
    "block_attention",
    "block_attention_grads",
    "full_mask",
    "hop_masks",
    "local_mask",
    "resolve_kernel",
]

MASK_VALUE = float(np.float32(-0.7 * float(np.finfo(np.float32).max)))  # splash's and ours
LANES = 128  # tokens are padded to whole blocks of this
MAX_RUNS = 8  # most runs of evenly spaced positions a block may have
_MASKED = np.iinfo(np.int32).min  # the segment id of a masked key (no query has it)
FULL, NONE = "full", "none"
Entry = int | str  # per pair of runs: FULL, NONE, or o: query i sees key j iff i + o ≥ j


AUTO_MIN_KEYS = 1024  # "auto" runs Pallas from this many keys per block on (v5e crossover)


def resolve_kernel(kernel: str, keys: int | None = None) -> str:
    """The kernel ("jnp" or "pallas") a plan's ``kernel`` runs. "auto" is Pallas on a TPU
    backend for blocks of at least ``AUTO_MIN_KEYS`` keys (``keys``; None: any), else jnp: on
    a v5e, XLA's fused attention is faster up to 512 keys (1.4× at 256) and Pallas from 1,024
    (2.2× there, 3-4× at 4,096 in a tenth of the memory; docs/strategies/kernels.md)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}; got {kernel!r}.")
    if kernel == "auto":
        long_enough = keys is None or keys >= AUTO_MIN_KEYS
        return "pallas" if jax.default_backend() == "tpu" and long_enough else "jnp"
    return kernel


# ----------------------------------------------------------------------------- masks


@dataclasses.dataclass(frozen=True)
class HopMask:
    """Which local (query i, key j) pairs are visible: the block is ``runs`` runs of ``length``
    tokens on each side, and ``entries[a][b]`` says it for query run a against key run b."""

    runs: int
    length: int
    entries: tuple[tuple[Entry, ...], ...]

    @property
    def empty(self) -> bool:
        return all(e == NONE for row in self.entries for e in row)

    @property
    def full(self) -> bool:
        return all(e == FULL for row in self.entries for e in row)

    def visible(self, q: np.ndarray | Array, k: np.ndarray | Array) -> np.ndarray | Array:
        """Elementwise on index arrays (NumPy while splash plans its blocks, jnp in the
        kernel): comparisons and logical operators only."""
        length, seen = self.length, None
        for a, row in enumerate(self.entries):
            for b, entry in enumerate(row):
                if entry == NONE:
                    continue
                pair = (q >= a * length) & (q < (a + 1) * length)
                pair = pair & (k >= b * length) & (k < (b + 1) * length)
                if entry != FULL:  # i + o ≥ j in run-local indices
                    pair = pair & (q + (int(entry) + (b - a) * length) >= k)
                seen = pair if seen is None else seen | pair
        return (q < 0) & (k < 0) if seen is None else seen  # nothing: all False


def full_mask(t: int, s: int) -> HopMask:
    """Every query sees every key (bidirectional attention)."""
    return HopMask(1, max(t, s), ((FULL,),))


def _runs(rows: np.ndarray) -> tuple[int, int]:
    """(runs R, step): the fewest R splitting every row into R runs of one common spacing."""
    t = rows.shape[1]
    for r in range(1, min(MAX_RUNS, t) + 1):
        if t % r:
            continue
        runs = rows.reshape(rows.shape[0], r, t // r)
        steps = np.diff(runs, axis=-1)
        if steps.size == 0:
            return r, 1
        if np.all(steps == steps.flat[0]) and steps.flat[0] > 0:
            return r, int(steps.flat[0])
    raise ValueError(
        f"the Pallas attention kernel needs each block's token positions in at most {MAX_RUNS} "
        f"runs of evenly spaced positions; this layout's {t}-token blocks have more."
    )


def _entry(q0: int, k0: int, step: int, length: int) -> Entry:
    """Query run from q0, key run from k0, both spaced ``step``: i sees j iff
    q0 + i·step ≥ k0 + j·step, i.e. i + floor((q0 − k0)/step) ≥ j."""
    offset = (q0 - k0) // step
    if offset >= length - 1:
        return FULL
    if offset < -(length - 1):
        return NONE
    return offset


def hop_masks(
    q_table: np.ndarray, k_table: np.ndarray | None = None
) -> tuple[tuple[HopMask, ...], np.ndarray]:
    """Causal masks of a ring: (the distinct masks, case [n, n] indexing them by (receiver,
    source)), from the global positions [n, t] each device's queries (and keys) hold."""
    k_table = q_table if k_table is None else k_table
    n, t = q_table.shape
    runs, step = _runs(np.concatenate([q_table, k_table]))
    length = t // runs
    found: dict[HopMask, int] = {}
    case = np.zeros((n, k_table.shape[0]), np.int32)
    q_starts, k_starts = q_table[:, ::length], k_table[:, ::length]  # [n, runs] each
    for me in range(n):
        for src in range(k_table.shape[0]):
            entries = tuple(
                tuple(_entry(int(q0), int(k0), step, length) for k0 in k_starts[src])
                for q0 in q_starts[me]
            )
            mask = HopMask(runs, length, entries)
            case[me, src] = found.setdefault(mask, len(found))
    return tuple(found), case


Piece = tuple[slice, slice, HopMask]  # query rows, key columns, the one-run mask between them


@functools.lru_cache(maxsize=64)
def _pieces(mask: HopMask) -> tuple[Piece, ...]:
    """A mask of several runs as rectangles each under one run's mask (everything, or one
    causal diagonal), which splash's own Full and CausalMask run at full speed. Per key run,
    consecutive query runs whose entries continue one diagonal (or are all FULL) share a
    rectangle; FULL rectangles over the same rows in adjacent key runs then join. A zigzag
    ring's hop is 1 or 2 rectangles."""
    length, found = mask.length, []  # [a0, a1, b0, b1, entry]
    for b in range(mask.runs):
        group: list | None = None
        for a in range(mask.runs):
            entry = mask.entries[a][b]
            if group is not None and _continues(group[4], a - group[0], entry, length):
                group[1] = a + 1
                continue
            if group is not None:
                found.append(group)
            group = None if entry == NONE else [a, a + 1, b, b + 1, entry]
        if group is not None:
            found.append(group)
    joined: list[list] = []
    for group in sorted(found, key=lambda g: (g[0], g[1], g[2])):
        last = joined[-1] if joined else None
        if last and last[:2] == group[:2] and last[3] == group[2] and FULL == last[4] == group[4]:
            last[3] = group[3]
        else:
            joined.append(group)
    return tuple(
        (slice(a0 * length, a1 * length), slice(b0 * length, b1 * length),
         HopMask(1, length * max(a1 - a0, b1 - b0), ((entry,),)))
        for a0, a1, b0, b1, entry in joined
    )  # fmt: skip


def _by_pieces(mask: HopMask) -> bool:
    """Whether ``mask`` runs as ``_pieces``' rectangles: several runs in at most as many
    rectangles (a zigzag hop: 1 or 2, each at full speed, where one kernel testing every run
    pair per block ran at 0.4-0.6x splash's throughput on a v5e). Interleaved runs (USP's
    striped blocks: a rectangle per run pair) stay one kernel."""
    return mask.runs > 1 and not mask.full and len(_pieces(mask)) <= mask.runs


def _continues(entry: Entry, height: int, below: Entry, length: int) -> bool:
    """Whether the query run ``height`` runs under a rectangle's first, with entry ``below``,
    extends that rectangle's one-run mask ``entry`` (offsets count from its first row)."""
    if below == NONE or entry == NONE:
        return False
    if entry == FULL:
        return below == FULL
    if below == FULL:  # every key visible from the run's first row on
        return height * length + int(entry) >= length - 1
    return int(below) - height * length == int(entry)


class _RunsMask(masks._ComputableMask):
    """A ``HopMask`` of several runs as one splash mask computed in the kernel on every block it
    visits (padding keys are masked by segment ids, padding queries are dropped): for masks
    whose runs interleave (USP's striped blocks), where ``_pieces`` would cut many rectangles."""

    def __init__(self, mask: HopMask, shape: tuple[int, int]) -> None:
        self.hop = mask
        super().__init__(shape=shape, mask_function=mask.visible)

    def _key(self) -> tuple:
        return (self.hop, self.shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _RunsMask) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


# ----------------------------------------------------------------------------- kernels


def _padded(n: int) -> int:
    return -(-n // LANES) * LANES


BLOCK = 1024  # most tokens per kernel block (measured on a v5e: docs/strategies/kernels.md)


def _block(n: int) -> int:
    """The largest power-of-two multiple of 128 up to ``BLOCK`` dividing n (a multiple of 128)."""
    b = BLOCK
    while n % b:
        b //= 2
    return max(b, LANES)


@functools.lru_cache(maxsize=64)
def _kernel(
    mask: HopMask, t: int, s: int, group: int, interpret: bool
) -> splash.SplashAttentionKernel:
    """The splash multi-query kernel (forward with lse; fused backward blocks) of one mask and
    shape: ``group`` query heads against one key head (run per key head: GQA, MHA as g = 1)."""
    tp, sp = _padded(t), _padded(s)
    bq, bkv = _block(tp), _block(sp)
    sizes = splash.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        use_fused_bwd_kernel=True,
    )
    with jax.ensure_compile_time_eval():  # concrete mask arrays: the cache outlives a trace
        return splash.make_splash_mqa(
            masks.MultiHeadMask([_splash_mask(mask, (tp, sp))] * group),
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=1,
            save_residuals=True,
            interpret=interpret,
        )


def _splash_mask(mask: HopMask, shape: tuple[int, int]) -> masks.Mask:
    """The cheapest splash mask for ``mask``: splash's own full and causal masks for one run
    (no test, or one comparison per element), else the runs tested on every visited block."""
    if mask.full:
        return masks.FullMask(shape)
    if mask.runs == 1:
        return masks.CausalMask(shape, offset=int(mask.entries[0][0]))
    return _RunsMask(mask, shape)


def _segments(
    b: int, t: int, s: int, q_seg: Array | None, kv_seg: Array | None, key_valid: Array | None
) -> splash.SegmentIds | None:
    """Splash segment ids [b, t_padded], [b, s_padded]: a masked or padding key is _MASKED.
    None when nothing needs them (the kernel then compares no segments)."""
    if q_seg is None and kv_seg is None and key_valid is None and s == _padded(s):
        return None
    q_ids = jnp.zeros((b, t), jnp.int32) if q_seg is None else q_seg.astype(jnp.int32)
    k_ids = jnp.zeros((b, s), jnp.int32) if kv_seg is None else kv_seg.astype(jnp.int32)
    if key_valid is not None:
        k_ids = jnp.where(jnp.broadcast_to(key_valid, (b, s)), k_ids, _MASKED)
    q_ids = jnp.pad(q_ids, ((0, 0), (0, _padded(t) - t)))
    k_ids = jnp.pad(k_ids, ((0, 0), (0, _padded(s) - s)), constant_values=_MASKED)
    return splash.SegmentIds(q_ids, k_ids)


def _to_heads(x: Array, kv_heads: int, length: int) -> Array:
    """[b, t, h, d] -> [b, h_kv, h/h_kv, t_padded, d] (grouped heads next to their key head)."""
    b, t, h, d = x.shape
    x = jnp.pad(x, ((0, 0), (0, length - t), (0, 0), (0, 0)))
    return jnp.transpose(x, (0, 2, 1, 3)).reshape(b, kv_heads, h // kv_heads, length, d)


def _from_heads(x: Array, t: int) -> Array:
    """[b, h_kv, g, t_padded, d] -> [b, t, h, d]."""
    b, n, g, _, d = x.shape
    return jnp.transpose(x.reshape(b, n * g, -1, d)[:, :, :t], (0, 2, 1, 3))


def _kv_heads(x: Array, length: int) -> Array:
    """[b, s, h_kv, d] -> [b, h_kv, s_padded, d]."""
    x = jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
    return jnp.transpose(x, (0, 2, 1, 3))


def _per_key_head(fn: Callable, *args: Array) -> Array:
    """``fn`` over batch and key heads (args [b, h_kv, ...]; segment ids [b, ...] shared)."""
    return jax.vmap(jax.vmap(fn, in_axes=(0, 0, 0, None)), in_axes=(0, 0, 0, 0))(*args)


def _operands(
    q: Array, k: Array, v: Array, mask: HopMask, segs: tuple, interpret: bool | None
) -> tuple[splash.SplashAttentionKernel, tuple[Array, ...], splash.SegmentIds | None]:
    """What both directions hand splash: the kernel, q scaled (splash does not scale the
    logits) [b, h_kv, g, t_p, d], k, v [b, h_kv, s_p, d], and the segment ids of ``segs`` =
    (q_seg, kv_seg, key_valid)."""
    (b, t, h, d), s, n = q.shape, k.shape[1], k.shape[2]
    kernel = _kernel(mask, t, s, h // n, _interpret(interpret))
    blocks = (
        _to_heads(q * d**-0.5, n, _padded(t)),
        _kv_heads(k, _padded(s)),
        _kv_heads(v, _padded(s)),
    )
    return kernel, blocks, _segments(b, t, s, *segs)


def block_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: HopMask,
    *,
    q_seg: Array | None = None,
    kv_seg: Array | None = None,
    key_valid: Array | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Array]:
    """(out [b, t, h, d] in q's dtype, lse [b, h, t] float32) of q against one key block.

    ``mask`` is static; q_seg [b, t] / kv_seg [b, s] segment ids and key_valid [(b,) s] are
    data. ``interpret``: None runs Pallas' interpreter off a TPU.
    """
    segs = (q_seg, kv_seg, key_valid)
    if _by_pieces(mask):
        return _attention_by_pieces(q, k, v, mask, segs, interpret)
    b, t, h = q.shape[:3]
    kernel, blocks, seg = _operands(q, k, v, mask, segs, interpret)

    def one(qh: Array, kh: Array, vh: Array, seg: splash.SegmentIds) -> tuple[Array, Array]:
        out, (lse,) = kernel(qh, kh, vh, segment_ids=seg)
        return out, lse

    out, lse = _run(functools.partial(_per_key_head, one), *blocks, seg)
    lse = lse.reshape(b, h, -1)[..., :t]
    has_key = lse > MASK_VALUE / 2
    out = jnp.where(jnp.swapaxes(has_key, 1, 2)[..., None], _from_heads(out, t), 0)
    return out.astype(q.dtype), jnp.where(has_key, lse, MASK_VALUE)


def block_attention_grads(
    q: Array,
    k: Array,
    v: Array,
    mask: HopMask,
    d_out: Array,
    lse: Array,
    delta: Array,
    *,
    q_seg: Array | None = None,
    kv_seg: Array | None = None,
    key_valid: Array | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Array, Array]:
    """Float32 (dq, dk, dv) of this key block, from the queries' log-sum-exp lse [b, h, t] and
    delta [b, h, t] over every block they attend (probabilities recomputed as exp(s − lse))."""
    segs = (q_seg, kv_seg, key_valid)
    if _by_pieces(mask):
        return _grads_by_pieces(q, k, v, mask, d_out, lse, delta, segs, interpret)
    (b, t, h, d), s, n = q.shape, k.shape[1], k.shape[2]
    tp = _padded(t)
    kernel, (qh, kh, vh), seg = _operands(q, k, v, mask, segs, interpret)
    # A row with no key: p = exp(s − lse) must be 0, not exp(MASK − MASK) = 1.
    lse = jnp.where(lse > MASK_VALUE / 2, lse, np.finfo(np.float32).max)
    rows = functools.partial(jnp.pad, pad_width=((0, 0), (0, 0), (0, tp - t)))
    lse_h = rows(lse).reshape(b, n, h // n, tp)
    delta_h = rows(delta.astype(jnp.float32)).reshape(b, n, h // n, tp)
    doh = _to_heads(d_out.astype(q.dtype), n, tp)
    bwd = functools.partial(
        splash._splash_attention_bwd_dkv,
        sinks=None,
        bq=kernel.kwargs["block_sizes"].block_q_dkv,
        bkv=kernel.kwargs["block_sizes"].block_kv_dkv,
        bkv_compute=kernel.kwargs["block_sizes"].block_kv_dkv_compute,
        is_mqa=True,
        mask_info=kernel.dkv_mask_info,  # type: ignore[arg-type]
        mask_value=MASK_VALUE,
        attn_logits_soft_cap=None,
        use_fused_bwd_kernel=True,
        q_layout=splash.QKVLayout.HEAD_DIM_MINOR,
        k_layout=splash.QKVLayout.HEAD_DIM_MINOR,
        v_layout=splash.QKVLayout.HEAD_DIM_MINOR,
        mask_function=kernel.kwargs["mask_function"],
        interpret=kernel.kwargs["interpret"],
    )

    def one(
        qh: Array, kh: Array, vh: Array, seg: splash.SegmentIds, rows: tuple
    ) -> tuple[Array, Array, Array]:
        do, lse, delta = rows
        return bwd(qh, kh, vh, seg, logsumexp=lse, do=do, di=delta)

    per_head = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None, 0)), in_axes=(0, 0, 0, 0, 0))
    dq, dk, dv = _run(per_head, qh, kh, vh, seg, (doh, lse_h, delta_h))
    f32 = jnp.float32
    dk, dv = (jnp.transpose(x[:, :, :s], (0, 2, 1, 3)).astype(f32) for x in (dk, dv))
    return (_from_heads(dq, t) * d**-0.5).astype(f32), dk, dv


def _piece_segs(segs: tuple, rows: slice, cols: slice) -> dict[str, Array | None]:
    q_seg, kv_seg, key_valid = segs
    return {
        "q_seg": None if q_seg is None else q_seg[:, rows],
        "kv_seg": None if kv_seg is None else kv_seg[:, cols],
        "key_valid": None if key_valid is None else key_valid[..., cols],
    }


def _padded_to(x: Array, axis: int, where: slice, size: int, value: float = 0.0) -> Array:
    """``x`` placed at ``where`` along ``axis`` of a length-``size`` array filled with ``value``."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (where.start, size - where.stop)
    return jnp.pad(x, pad, constant_values=value)


def _attention_by_pieces(
    q: Array, k: Array, v: Array, mask: HopMask, segs: tuple, interpret: bool | None
) -> tuple[Array, Array]:
    """``block_attention`` of a several-run mask: each rectangle of ``_pieces`` on its own
    kernel, merged by log-sum-exp (rows a rectangle misses weigh 0)."""
    t = q.shape[1]
    out, lse = None, None
    for rows, cols, piece in _pieces(mask):
        part = block_attention(q[:, rows], k[:, cols], v[:, cols], piece, interpret=interpret,
                               **_piece_segs(segs, rows, cols))  # fmt: skip
        o = _padded_to(part[0].astype(jnp.float32), 1, rows, t)
        o_lse = _padded_to(part[1], 2, rows, t, MASK_VALUE)
        if out is None or lse is None:
            out, lse = o, o_lse
            continue
        new = jnp.logaddexp(lse, o_lse)
        weight = [jnp.swapaxes(jnp.exp(x - new), 1, 2)[..., None] for x in (lse, o_lse)]
        out, lse = out * weight[0] + o * weight[1], new
    assert out is not None and lse is not None  # a non-empty mask has a rectangle
    has_key = lse > MASK_VALUE / 2
    return out.astype(q.dtype), jnp.where(has_key, lse, MASK_VALUE)


def _grads_by_pieces(
    q: Array, k: Array, v: Array, mask: HopMask, d_out: Array, lse: Array, delta: Array,
    segs: tuple, interpret: bool | None,
) -> tuple[Array, Array, Array]:  # fmt: skip
    """``block_attention_grads`` of a several-run mask: the rectangles' gradients summed."""
    t, s = q.shape[1], k.shape[1]
    dq_all, dk_all, dv_all = [], [], []
    for rows, cols, piece in _pieces(mask):
        dq, dk, dv = block_attention_grads(
            q[:, rows], k[:, cols], v[:, cols], piece, d_out[:, rows], lse[..., rows],
            delta[..., rows], interpret=interpret, **_piece_segs(segs, rows, cols),
        )  # fmt: skip
        dq_all.append(_padded_to(dq, 1, rows, t))
        dk_all.append(_padded_to(dk, 1, cols, s))
        dv_all.append(_padded_to(dv, 1, cols, s))
    return sum(dq_all[1:], dq_all[0]), sum(dk_all[1:], dk_all[0]), sum(dv_all[1:], dv_all[0])


def _run(fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` (a splash call) inside ``shard_map`` too. Splash's output shapes carry no
    shard_map type, which a ``check_vma=True`` trace refuses; so the call is traced with the
    check off (JAX's own switch, private in 0.10.2) and its results typed as varying over
    every mesh axis an argument varies over: what they do."""
    axes = frozenset().union(*(jax.typeof(x).mat.varying for x in jax.tree.leaves(args)))
    with _jax_config._check_vma(False):
        outs = fn(*args)

    def typed(x: Array) -> Array:
        missing = tuple(sorted(axes - jax.typeof(x).mat.varying))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(typed, outs)


def _interpret(interpret: bool | None) -> bool:
    return jax.default_backend() != "tpu" if interpret is None else interpret


# ----------------------------------------------------------------------------- differentiable


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 7))
def attend(
    q: Array,
    k: Array,
    v: Array,
    mask: HopMask,
    q_seg: Array | None,
    kv_seg: Array | None,
    key_valid: Array | None,
    interpret: bool | None,
) -> tuple[Array, Array]:
    """``block_attention`` with its backward (saves q, k, v, out, lse): one whole block."""
    return block_attention(
        q, k, v, mask, q_seg=q_seg, kv_seg=kv_seg, key_valid=key_valid, interpret=interpret
    )


def _attention_fwd(
    q: Array,
    k: Array,
    v: Array,
    mask: HopMask,
    q_seg: Array | None,
    kv_seg: Array | None,
    key_valid: Array | None,
    interpret: bool | None,
) -> tuple[tuple[Array, Array], tuple]:
    out, lse = attend(q, k, v, mask, q_seg, kv_seg, key_valid, interpret)
    return (out, lse), (q, k, v, q_seg, kv_seg, key_valid, out, lse)


def _attention_bwd(mask: HopMask, interpret: bool | None, res: tuple, cts: tuple) -> tuple:
    q, k, v, q_seg, kv_seg, key_valid, out, lse = res
    d_out, d_lse = cts
    f32 = jnp.float32
    delta = jnp.swapaxes(jnp.sum(d_out.astype(f32) * out.astype(f32), -1), 1, 2) - d_lse
    dq, dk, dv = block_attention_grads(
        q, k, v, mask, d_out, lse, delta,
        q_seg=q_seg, kv_seg=kv_seg, key_valid=key_valid, interpret=interpret,
    )  # fmt: skip
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


attend.defvjp(_attention_fwd, _attention_bwd)


def local_mask(t: int, s: int, causal: bool) -> HopMask:
    """The mask of whole local blocks: everything, or causal from position 0 on both sides."""
    if not causal:
        return full_mask(t, s)
    return hop_masks(np.arange(t)[None, :], np.arange(s)[None, :])[0][0]
