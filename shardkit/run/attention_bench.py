"""``shardkit bench --attention``: one device's attention forward + backward, shardkit's kernels
against JAX's, per sequence length, bidirectional and causal.

Shape: b 1, 8 heads × 128, bfloat16 (``SHAPE``). Each contender is one jitted ``jax.vjp`` of
q, k, v [b, T, h, d] with a random cotangent, compiled ahead of time:

- ``shardkit jnp`` / ``shardkit pallas``: ``attention_ring`` over a one-device mesh (n = 1:
  the hop compute, no communication) on that kernel;
- ``zigzag d/n`` (causal, ``ring`` = n > 1, Pallas): ring device d's share of a causal zigzag
  ring of n: its T/n queries against each of the n key blocks, with the kernel of each hop's
  mask (``kernels.hop_masks``), merged by log-sum-exp, and each hop's backward from the merged
  lse: the kernel calls ``attention_ring`` makes on that device, without the ppermutes; 1/n of
  the causal work;
- ``splash``: JAX's splash kernel over the whole sequence, blocks of ``kernels.attention.BLOCK``
  (with the Pallas kernel);
- ``xla``: ``jax.nn.dot_product_attention`` (XLA's own; it holds the T×T logits).

A row: the median of ``steps`` timed calls after ``warmup``; TFLOP/s from 14·b·h·T²·d per step
(forward 4, backward 10; halved when causal; a zigzag device does 1/n of it); the compiled
step's temp bytes (``memory_analysis``); and the largest difference of its output from a
float32 reference at "highest" precision (``reference``; a zigzag device: its rows). A
contender that does not compile or run (out of memory) is a row with its error. Off a TPU, the
Pallas rows run in Pallas' interpreter: right, but their times say nothing about a chip.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.sharding import PartitionSpec as P

from shardkit import kernels
from shardkit.kernels import attention as kernel_lib
from shardkit.parallel.sequence import attention_ring, layouts
from shardkit.run import bench

BATCH, HEADS, HEAD_DIM, DTYPE = 1, 8, 128, "bfloat16"
SHAPE = {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": DTYPE}
TPU_TOKENS = (4096, 8192, 16384, 32768)
CPU_TOKENS = (512, 1024)
Step = Callable[[jax.Array, jax.Array, jax.Array], Any]


@dataclasses.dataclass
class Row:
    tokens: int
    causal: bool
    contender: str
    ms: float | None = None
    tflops: float | None = None
    temp_gb: float | None = None
    max_diff: float | None = None
    error: str | None = None


def default_tokens() -> tuple[int, ...]:
    """4k–32k on a TPU; short sequences elsewhere (a CPU takes seconds per 1k-token step)."""
    return TPU_TOKENS if jax.default_backend() == "tpu" else CPU_TOKENS


def default_kernels(kernel: str) -> tuple[str, ...]:
    """shardkit's kernels to time: the one asked for, or (auto) both on a TPU, jnp elsewhere."""
    if kernel != "auto":
        return (kernel,)
    return ("pallas", "jnp") if jax.default_backend() == "tpu" else ("jnp",)


def check(tokens: Sequence[int], ring: int) -> None:
    """ValueError unless every length splits over a zigzag ring of ``ring`` devices."""
    if ring < 1:
        raise ValueError(f"--ring takes a device count >= 1, got {ring}.")
    bad = [t for t in tokens if t % layouts.multiple("zigzag", ring)]
    if bad:
        raise ValueError(
            f"{bad[0]} tokens do not split over a zigzag ring of {ring}: give multiples of "
            f"{layouts.multiple('zigzag', ring)}."
        )


# ----------------------------------------------------------------------------- contenders


def shardkit_step(kernel: str, causal: bool) -> Step:
    """``attention_ring`` at n = 1 on ``kernel``."""
    mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    ring = functools.partial(attention_ring, axis="seq", causal=causal, kernel=kernel)
    spec = P(None, "seq")
    return jax.shard_map(lambda q, k, v: ring(q, k, v)[0], mesh=mesh, in_specs=spec, out_specs=spec)


def splash_step(tokens: int, causal: bool, heads: int) -> Step:
    """JAX's splash kernel on the whole sequence (multi-head, fused backward)."""
    shape = (tokens, tokens)
    mask = masks.CausalMask(shape) if causal else masks.FullMask(shape)
    block = min(kernel_lib.BLOCK, tokens)
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True,
    )  # fmt: skip
    kernel = splash.make_splash_mha(
        masks.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1,
        interpret=jax.default_backend() != "tpu",
    )  # fmt: skip

    def run(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        qh, kh, vh = (jnp.swapaxes(x, 1, 2) for x in (q * q.shape[-1] ** -0.5, k, v))
        return jnp.swapaxes(jax.vmap(kernel)(qh, kh, vh), 1, 2)  # splash: [h, t, d] per row

    return run


def xla_step(causal: bool) -> Step:
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)


def zigzag_device_step(ring: int, device: int, tokens: int) -> Step:
    """Device ``device``'s hops of a causal zigzag ring of ``ring`` over ``tokens``: its queries
    q [b, T/n, h, d] against k, v [b, T, h, d] in the zigzag layout (``layouts.to_layout``).
    The backward is written out as ``attention_ring``'s: each hop's (dq, dk, dv) from the merged
    lse and delta."""
    t = tokens // ring
    hop_masks, case = kernels.hop_masks(layouts.positions("zigzag", ring, t))
    hops = [
        (j, hop_masks[case[device, j]]) for j in range(ring) if not hop_masks[case[device, j]].empty
    ]

    def blocks(x: jax.Array) -> list[jax.Array]:
        return [x[:, j * t : (j + 1) * t] for j in range(ring)]

    def forward(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        ks, vs = blocks(k), blocks(v)
        parts = [kernels.block_attention(q, ks[j], vs[j], mask) for j, mask in hops]
        lse = jax.nn.logsumexp(jnp.stack([part_lse for _, part_lse in parts]), axis=0)
        weighted = [
            o.astype(jnp.float32) * jnp.swapaxes(jnp.exp(part_lse - lse), 1, 2)[..., None]
            for o, part_lse in parts
        ]
        return sum(weighted[1:], weighted[0]).astype(q.dtype), lse

    def backward(res: tuple, d_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q, k, v, out, lse = res
        ks, vs = blocks(k), blocks(v)
        delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1)
        dq, dk, dv = jnp.zeros(q.shape, jnp.float32), [0 * x for x in ks], [0 * x for x in vs]
        for j, mask in hops:
            grads = kernels.block_attention_grads(
                q, ks[j], vs[j], mask, d_out, lse, jnp.swapaxes(delta, 1, 2)
            )
            dq, dk[j], dv[j] = dq + grads[0], grads[1].astype(k.dtype), grads[2].astype(v.dtype)
        return dq.astype(q.dtype), jnp.concatenate(dk, 1), jnp.concatenate(dv, 1)

    @jax.custom_vjp
    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return forward(q, k, v)[0]

    def attend_fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, tuple]:
        out, lse = forward(q, k, v)
        return out, (q, k, v, out, lse)

    attend.defvjp(attend_fwd, backward)
    return attend


# ----------------------------------------------------------------------------- measuring


def timed_vjp(fn: Step, args: tuple[jax.Array, ...], steps: int, warmup: int) -> dict:
    """ms (median), temp GB and the output of one jitted forward + backward of ``fn``."""

    def step(d_out: jax.Array, *args: jax.Array) -> Any:
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(d_out)

    with jax.numpy_dtype_promotion("standard"):  # dot_product_attention mixes dtypes inside
        shape = jax.eval_shape(fn, *args)
        args = (jax.random.normal(jax.random.key(1), shape.shape, shape.dtype), *args)
        compiled = jax.jit(step).lower(*args).compile()
    out = jax.block_until_ready(compiled(*args))[0]
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    memory = compiled.memory_analysis()
    temp_gb = None if memory is None else memory.temp_size_in_bytes / 1e9
    return {"ms": 1e3 * statistics.median(times), "temp_gb": temp_gb, "out": out}


class Contender(NamedTuple):
    """A step, its arguments, the rows of a whole-sequence output it computes, and its share of
    the sequence's attention work."""

    step: Step
    args: tuple[jax.Array, ...]
    rows: Callable[[jax.Array], jax.Array] = lambda whole: whole
    share: float = 1.0


def _contenders(
    tokens: int, causal: bool, kernel_names: Sequence[str], ring: int, qkv: tuple
) -> dict[str, Contender]:
    """The contenders of one length and mask."""
    named = {"xla": Contender(xla_step(causal), qkv)}
    if "pallas" in kernel_names:
        named["splash"] = Contender(splash_step(tokens, causal, HEADS), qkv)
    for kernel in kernel_names:
        named[f"shardkit {kernel}"] = Contender(shardkit_step(kernel, causal), qkv)
    if "pallas" in kernel_names and causal and ring > 1:
        named.update(_zigzag_devices(tokens, ring, qkv))
    return named


def _zigzag_devices(tokens: int, ring: int, qkv: tuple) -> dict[str, Contender]:
    """The first and last devices of a causal zigzag ring of ``ring`` (equal work by design)."""
    t = tokens // ring
    q, k, v = (layouts.to_layout(x, ring, "zigzag") for x in qkv)
    named = {}
    for d in sorted({0, ring - 1}):

        def rows(whole: jax.Array, d: int = d) -> jax.Array:
            return layouts.to_layout(whole, ring, "zigzag")[:, d * t : (d + 1) * t]

        args = (q[:, d * t : (d + 1) * t], k, v)
        named[f"zigzag {d}/{ring}"] = Contender(
            zigzag_device_step(ring, d, tokens), args, rows, 1 / ring
        )
    return named


@functools.partial(jax.jit, static_argnums=3)
def reference(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    """Float32 attention at "highest" matmul precision, 1,024 queries at a time (so 32k tokens
    fit a chip): what every row's ``max_diff`` is measured against."""
    (b, t, h, d), chunk = q.shape, math.gcd(q.shape[1], 1024)
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    dot = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)

    def rows(start: jax.Array) -> jax.Array:
        qc = jax.lax.dynamic_slice_in_dim(q, start, chunk, axis=1)
        logits = dot("bqhd,bkhd->bhqk", qc, k) * d**-0.5
        if causal:
            visible = start + jnp.arange(chunk)[:, None] >= jnp.arange(t)[None]
            logits = jnp.where(visible, logits, -jnp.inf)
        return dot("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)

    out = jax.lax.map(rows, jnp.arange(0, t, chunk))  # [t / chunk, b, chunk, h, d]
    return jnp.swapaxes(out, 0, 1).reshape(b, t, h, d)


def _flops(tokens: int, causal: bool) -> float:
    """Forward (4) + backward (10) matmul FLOPs of the whole sequence, halved when causal."""
    return 14 * BATCH * HEADS * tokens**2 * HEAD_DIM * (0.5 if causal else 1.0)


def _measured(
    tokens: int, causal: bool, name: str, c: Contender, steps: int, warmup: int
) -> tuple[Row, Any]:
    """(the contender's row, its output; None if it did not compile or run)."""
    try:
        result = timed_vjp(c.step, c.args, steps, warmup)
    except Exception as err:  # out of memory, or a shape it refuses: the row says so
        return Row(tokens, causal, name, error=str(err).splitlines()[0][:200]), None
    ms, work = result["ms"], _flops(tokens, causal) * c.share
    row = Row(tokens, causal, name, ms=ms, tflops=work / ms / 1e9, temp_gb=result["temp_gb"])
    return row, result["out"]


def run(
    tokens: Sequence[int],
    kernel_names: Sequence[str],
    ring: int = 1,
    *,
    steps: int = 5,
    warmup: int = 1,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every contender at every length, bidirectional and causal: ``{"device", "backend",
    "shape", "block", "ring", "rows"}`` (rows as ``Row`` dicts)."""
    check(tokens, ring)
    rows = []
    for t in tokens:
        keys = jax.random.split(jax.random.key(t), 3)
        shape = (BATCH, t, HEADS, HEAD_DIM)
        qkv = tuple(jax.random.normal(key, shape, jnp.dtype(DTYPE)) for key in keys)
        for causal in (False, True):
            ref = reference(*qkv, causal)
            for name, c in _contenders(t, causal, kernel_names, ring, qkv).items():
                progress(f"{t} tokens, {'causal' if causal else 'bidirectional'}: {name}")
                row, out = _measured(t, causal, name, c, steps, warmup)
                if out is not None:
                    row.max_diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - c.rows(ref))))
                rows.append(dataclasses.asdict(row))
    return {
        "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "shape": SHAPE,
        "block": kernel_lib.BLOCK,
        "ring": ring,
        "rows": rows,
    }


# ----------------------------------------------------------------------------- reporting


def _versus_splash(rows: list[dict]) -> dict[int, float]:
    """Row index -> its TFLOP/s over splash's at the same length and mask."""
    splash_tflops = {
        (r["tokens"], r["causal"]): r["tflops"] for r in rows if r["contender"] == "splash"
    }
    ratios = {}
    for i, r in enumerate(rows):
        base = splash_tflops.get((r["tokens"], r["causal"]))
        if base and r["tflops"]:
            ratios[i] = r["tflops"] / base
    return ratios


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_table(result: dict[str, Any], markdown: bool = False) -> str:
    """The rows as a table (Markdown if asked), with the shape and where it ran."""
    shape = result["shape"]
    head = ["contender", "mask", "tokens", "ms", "TFLOP/s", "× splash", "temp GB", "max diff"]
    ratios = _versus_splash(result["rows"])
    lines, errors = [], []
    for i, r in enumerate(result["rows"]):
        mask = "causal" if r["causal"] else "bidir"
        if r["error"]:
            lines.append([r["contender"], mask, f"{r['tokens']:,}", "-", "-", "-", "-", "-"])
            errors.append(f"{r['contender']} at {r['tokens']:,} tokens ({mask}): {r['error']}")
            continue
        lines.append([
            r["contender"], mask, f"{r['tokens']:,}", f"{r['ms']:.2f}", f"{r['tflops']:.3g}",
            f"{ratios[i]:.2f}" if i in ratios else "-", _gb(r["temp_gb"]),
            "-" if r["max_diff"] is None else f"{r['max_diff']:.1e}",
        ])  # fmt: skip
    title = (
        f"attention forward + backward on one {result['device']} ({result['backend']}): b "
        f"{shape['batch']}, {shape['heads']} heads × {shape['head_dim']}, {shape['dtype']}; "
        f"Pallas blocks {result['block']}"
    )
    if result["backend"] != "tpu":
        title += "; Pallas rows interpreted (times say nothing about a chip)"
    return "\n".join([title, *bench.table_lines(head, lines, markdown), *errors])


def plot(result: dict[str, Any], path: str) -> None:
    """TFLOP/s against tokens per contender, bidirectional and causal side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["tflops"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, causal in zip(axes, (False, True), strict=True):
        for name in sorted({r["contender"] for r in rows if r["causal"] == causal}):
            mine = [r for r in rows if r["contender"] == name and r["causal"] == causal]
            ax.plot([r["tokens"] for r in mine], [r["tflops"] for r in mine], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title("causal" if causal else "bidirectional")
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("TFLOP/s, forward + backward")
    shape = result["shape"]
    fig.suptitle(
        f"Attention on one {result['device']}: b {shape['batch']}, {shape['heads']} heads × "
        f"{shape['head_dim']}, {shape['dtype']} (zigzag d/n: one device's share of a ring of n)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
