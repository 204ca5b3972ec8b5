"""Why a TP region starts with ONE Megatron f: backward all-reduces with and without it.

    python docs/measure/one_f_per_region.py

An activation x[B, D], invariant over ``model``, feeds three column-parallel matmuls (like q, k
and v). Without an explicit f each use casts x to varying on its own, and the transpose of each
cast is a psum of that use's cotangent: three all-reduces of dx (XLA may fuse them into one
tuple op: same bytes). With ``megatron_f`` first, the three cotangents are summed locally and
one dx is all-reduced.
"""

import shardkit

shardkit.set_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardkit import ledger  # noqa: E402

mesh = shardkit.make_mesh({"model": 2})


def loss_local(a, inp, w, u, explicit_f: bool):
    x = jnp.tanh(inp * a)  # x[B, D], invariant over model
    if explicit_f:
        x = shardkit.megatron_f(x, "model")
    # Three column-parallel x · W[D, F_model] then row-parallel · U[F_model, D]: y{U_model}.
    y = sum(jnp.tanh(x @ w[i]) @ u[i] for i in range(3))
    return jnp.sum(jax.lax.psum(y, "model") ** 2)  # Megatron g: one forward all-reduce


args = (jnp.float32(0.5), jnp.ones((4, 8)), jnp.ones((3, 8, 16)), jnp.ones((3, 16, 8)))
specs = (P(), P(), P(None, None, "model"), P(None, "model"))
for explicit in (False, True):
    body = lambda *a, explicit=explicit: loss_local(*a, explicit)  # noqa: E731
    grad = jax.jit(jax.grad(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())))
    led = ledger.measure(grad, *args, mesh=mesh)
    print("with one f:   " if explicit else "without f:    ", end="")
    print(
        ", ".join(f"{c.kind} of {list(c.shapes)} ({c.bytes_sent:.0f} B)" for c in led.collectives)
    )
