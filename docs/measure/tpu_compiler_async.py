"""Which gradient-sync and FSDP programs the TPU compiler overlaps with compute (no chip).

    python docs/measure/tpu_compiler_async.py     # ~3 minutes; results: docs/strategies/overlap.md

A stack of L residual MLP layers (D = 1,024, F = 4,096, 4,096 tokens per device, bf16
compute, float32 params) over ``data=8`` of a v5e:2x4 slice, one SGD step, compiled by libtpu
on this CPU machine. Each program's bytes per device and the fraction of them with a matmul
scheduled between the collective's start and done (``comm.ledger``; the TPU compiler's async
collective fusions included), under libtpu's default flags and under a set of its overlap
flags:

DP, gradients all-reduced
  end      one all-reduce of every gradient after the backward (shardkit's DP bucket)
  layer    each layer's gradients psum'd inside its backward (a custom_vjp), so the sync of
           layer l could run under layer l − 1's backward
  ring     the same per-layer sync as a ppermute ring (reduce-scatter then all-gather steps)
  behind   shardkit's ``--overlap``: layers scanned through ``data.prefetch_layers`` with
           ``data.sync_in_backward``, so layer l + 1's gradients are reduced in layer l's
           backward step, as recursive halving's exchanges and an all-gather
FSDP, layers stored split over data, scanned
  plain    each layer's weights all-gathered at the top of its step
  prefetch layer l + 1's all-gathered in layer l's step (``data.prefetch_layers``'s order)
  prefetch, bucketed   the same with the layer's two weights as one buffer, as shardkit's
           ``fsdp_gather`` sends them
  prefetch, permuted back   shardkit's ``--overlap``: the same, the bucket's reduce-scatter
           built from permutes (``fsdp_gather(..., permuted_back=True)``)
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import functools
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit
from shardkit.comm import ledger
from shardkit.parallel import data as dp
from shardkit.run import target

L, D, F, T, N = 4, 1024, 4096, 4096, 8
FLAGS = {
    "default": {},
    "overlap flags": dict.fromkeys((
        "xla_enable_async_all_reduce", "xla_enable_async_all_gather",
        "xla_enable_async_reduce_scatter_fusion", "xla_tpu_enable_async_collective_fusion",
        "xla_tpu_enable_async_collective_fusion_fuse_all_reduce",
        "xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter",
        "xla_tpu_enable_async_collective_fusion_multiple_steps",
        "xla_tpu_enable_data_parallel_all_reduce_opt", "xla_tpu_overlap_compute_collective_tc",
        "xla_tpu_enable_latency_hiding_scheduler",
    ), "true"),
}  # fmt: skip


def block(x, w1, w2):
    return x + jax.nn.gelu(x @ w1.astype(jnp.bfloat16)) @ w2.astype(jnp.bfloat16)


def ring_all_reduce(v):
    """psum of a flat v over data as 2(N − 1) ppermute steps."""
    i, chunks = jax.lax.axis_index("data"), v.reshape(N, -1)
    perm = [(j, (j + 1) % N) for j in range(N)]
    acc = jnp.take(chunks, i, axis=0)
    for s in range(1, N):
        acc = jax.lax.ppermute(acc, "data", perm) + jnp.take(chunks, (i - s) % N, axis=0)
    out = jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(chunks), acc, (i + 1) % N, 0)
    for s in range(1, N):
        acc = jax.lax.ppermute(acc, "data", perm)
        out = jax.lax.dynamic_update_index_in_dim(out, acc, (i + 1 - s) % N, 0)
    return out.reshape(-1)


def synced_in_backward(reduce):
    """Identity on a layer's weights whose backward reduces their gradients with ``reduce``."""

    @jax.custom_vjp
    def sync(ws):
        return ws

    def bwd(_, cts):
        flat = reduce(jnp.concatenate([c.reshape(-1) for c in cts]))
        return ([flat[: D * F].reshape(D, F), flat[D * F :].reshape(F, D)],)

    sync.defvjp(lambda ws: (ws, None), bwd)
    return sync


def dp_step(kind):
    reduce = {"layer": lambda v: jax.lax.psum(v, "data"), "ring": ring_all_reduce}.get(kind)

    def loss(ws, x):
        for k in range(L):
            w1, w2 = ws[2 * k : 2 * k + 2]
            if reduce is not None:
                w1, w2 = synced_in_backward(reduce)([w1, w2])
            x = block(x, w1, w2)
        return jnp.sum(x.astype(jnp.float32) ** 2)

    def step(ws, x):
        g = jax.grad(loss)(ws, x)
        if reduce is None:
            g = jax.lax.psum(g, "data")
        return [w - 1e-3 * gi for w, gi in zip(ws, g, strict=True)]

    return step


def dp_behind_step(ws, x):
    """shardkit's DP ``--overlap``: each layer's gradients synced one layer behind."""
    sync = functools.partial(dp.sync_in_backward, axes_tree=[("data",), ("data",)])
    loss = lambda ws: jnp.sum(  # noqa: E731
        dp.prefetch_layers(lambda x, w: block(x, *w), sync, x, ws).astype(jnp.float32) ** 2
    )
    return jax.tree.map(lambda w, gi: w - 1e-3 * gi, ws, jax.grad(loss)(ws))


def fsdp_permuted_step(ws, x):
    """shardkit's FSDP ``--overlap``: gathered one layer ahead, scattered one behind."""
    gather = functools.partial(dp.fsdp_gather, dims_tree=(0, 0), permuted_back=True)
    loss = lambda ws: jnp.sum(  # noqa: E731
        dp.prefetch_layers(lambda x, w: block(x, *w), gather, x, ws).astype(jnp.float32) ** 2
    )
    return jax.tree.map(lambda w, gi: w - 1e-3 * gi, ws, jax.grad(loss)(ws))


def gather(w1, w2, bucketed):
    if not bucketed:
        return tuple(jax.lax.all_gather(w, "data", axis=0, tiled=True) for w in (w1, w2))
    rows = w1.size // 128
    flat = jax.lax.all_gather(jnp.concatenate([w1.reshape(-1, 128), w2.reshape(-1, 128)]),
                              "data", axis=0)  # fmt: skip
    return (flat[:, :rows].reshape(-1, w1.shape[1]), flat[:, rows:].reshape(-1, w2.shape[1]))


def fsdp_step(kind):
    bucketed = kind == "prefetch, bucketed"

    def forward(ws, x):
        if kind == "plain":
            x, _ = jax.lax.scan(lambda x, w: (block(x, *gather(*w, False)), None), x, ws)
            return x

        def body(carry, nxt):
            x, here = carry
            return (block(x, *here), gather(*nxt, bucketed)), None

        first = gather(ws[0][0], ws[1][0], bucketed)
        (x, last), _ = jax.lax.scan(body, (x, first), (ws[0][1:], ws[1][1:]))
        return block(x, *last)

    def step(ws, x):
        g = jax.grad(lambda ws: jnp.sum(forward(ws, x).astype(jnp.float32) ** 2))(ws)
        return jax.tree.map(lambda w, gi: w - 1e-3 * gi, ws, g)

    return step


def compiled(fn, mesh, params, param_spec, flags):
    """The ledger of ``fn``'s step; shardkit's own programs (whose primitives type their
    values) under ``check_vma``, the hand-written ones without."""
    x = jax.ShapeDtypeStruct((N * T, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    typed = fn in (dp_behind_step, fsdp_permuted_step)
    f = jax.shard_map(fn, mesh=mesh, in_specs=(param_spec, P("data")), out_specs=param_spec,
                      check_vma=typed)  # fmt: skip
    with target.uncached():
        return ledger.ledger_of(jax.jit(f).lower(params, x).compile(flags), mesh)


def main() -> None:
    mesh = shardkit.make_mesh({"data": N}, devices=target.topology_devices("v5e:2x4").reshape(-1))
    sds = lambda shape, spec: jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.float32, sharding=NamedSharding(mesh, spec)
    )
    dp_params = [sds(s, P()) for _ in range(L) for s in ((D, F), (F, D))]
    fsdp_params = (sds((L, D, F), P(None, "data")), sds((L, F, D), P(None, "data")))
    stacked = (sds((L, D, F), P()), sds((L, F, D), P()))
    programs = [(f"DP {k}", dp_step(k), dp_params, P()) for k in ("end", "layer", "ring")]
    programs += [("DP behind (shardkit's --overlap)", dp_behind_step, stacked, P())]
    programs += [(f"FSDP {k}", fsdp_step(k), fsdp_params, P(None, "data"))
                 for k in ("plain", "prefetch", "prefetch, bucketed")]  # fmt: skip
    programs += [("FSDP prefetch, permuted back (shardkit's --overlap)", fsdp_permuted_step,
                  fsdp_params, P(None, "data"))]  # fmt: skip
    print("| program | collectives | MB per device | hidden, default flags | hidden, "
          "overlap flags |\n|---|---|---|---|---|")  # fmt: skip
    chosen = sys.argv[1:]  # names (prefixes) to compile; all by default
    for name, fn, params, spec in programs:
        if chosen and not any(name.startswith(c) for c in chosen):
            continue
        leds = {f: compiled(fn, mesh, params, spec, opts) for f, opts in FLAGS.items()}
        led = leds["default"]
        ops = ", ".join(f"{t.count} {k}" for (k, _), t in led.summary().items())
        hidden = " | ".join(f"{x.overlapped_fraction:.1%}" for x in leds.values())
        print(f"| {name} | {ops} | {led.total_bytes_sent() / 1e6:,.1f} | {hidden} |", flush=True)


if __name__ == "__main__":
    main()
