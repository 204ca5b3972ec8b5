"""Collective matmuls vs the plain all-gather / reduce-scatter and matmul, compiled for a v5e:2x4
slice by the TPU compiler on a CPU machine (libtpu, no chip): bytes per device, collectives,
and the fraction of the bytes with a matmul scheduled between a collective's start and done.

    python docs/measure/overlap_tpu_compiler.py     # results: docs/strategies/overlap.md

A column-then-row block x[M_model, K] -> ag · w1[K, F_model] -> gelu -> · w2[F_model, K] ->
reduce-scatter, forward and backward, bf16, M = 8,192, K = 2,048, F = 8,192.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit
from shardkit.comm import ledger
from shardkit.parallel import collectives, overlap
from shardkit.run import target

M, K, F = 8 * 1024, 2048, 8 * 1024
PROGRAMS = {
    "plain": (lambda x, w: collectives.all_gather(x, "model", axis_dim=0, tiled=True) @ w,
              lambda a, w: collectives.reduce_scatter(a @ w, "model", scatter_dim=0, tiled=True)),
    "collective matmuls": (lambda x, w: overlap.ag_matmul(x, w, "model"),
                           lambda a, w: overlap.matmul_rs(a, w, "model")),
}  # fmt: skip


def grad_step(mesh, ag, rs):
    def body(x, w1, w2):
        return rs(jax.nn.gelu(ag(x, w1)), w2)

    specs = (P("model"), P(None, "model"), P("model"))
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("model"))
    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2), (0, 1, 2)))


def main() -> None:
    devices = target.topology_devices("v5e:2x4").reshape(-1)
    mesh = shardkit.make_mesh({"model": 8}, devices=devices)
    arg = lambda shape, spec: jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec)
    )
    args = (arg((M, K), P("model")), arg((K, F), P(None, "model")), arg((F, K), P("model")))
    for name, (ag, rs) in PROGRAMS.items():
        led = ledger.ledger_of(grad_step(mesh, ag, rs).lower(*args).compile(), mesh)
        ops = ", ".join(f"{t.count} {kind}" for (kind, _), t in led.summary().items())
        print(f"{name:<20} {led.total_bytes_sent():>14,.0f} B  {led.overlapped_fraction:6.1%} "
              f"overlapped  ({ops})")  # fmt: skip


if __name__ == "__main__":
    main()
