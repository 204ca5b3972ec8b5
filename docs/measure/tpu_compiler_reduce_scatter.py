"""Which all-gathers and reduce-scatters the TPU compiler keeps, by operand shape (any machine
with libtpu; no chip): FSDP's 2x bytes on the TPU compiler (docs/target.md).

For each per-device shape, a shard_map over the 8 chips of v5e:2x4 all-gathers a float32
fragment (tiled), uses it, and takes the gradient, whose transpose is a reduce-scatter; the
compiled TPU program's collective kinds are printed. Results: docs/measure/results/
tpu_compiler_reduce_scatter.txt.

    python docs/measure/tpu_compiler_reduce_scatter.py
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

SHAPES = [(1000,), (1024,), (8192,), (110592,), (110664,), (1048576,), (8, 128), (16, 128),
          (24, 128), (32, 128), (48, 128), (56, 128), (64, 128), (864, 128), (865, 128),
          (864, 256), (6912, 128), (6920, 128), (6928, 128), (6944, 128), (6976, 128),
          (7040, 128), (7168, 128), (8192, 128), (9216, 128), (10240, 128), (12288, 128),
          (16384, 128), (3464, 256), (1732, 512), (110664, 1)]  # fmt: skip
KIND = re.compile(r"\b(all-gather|reduce-scatter|all-reduce)(?:-start)?\(")


def kinds(mesh: jax.sharding.Mesh, local: tuple[int, ...]) -> list[str]:
    def step(x: jax.Array, w: jax.Array) -> jax.Array:
        def loss(x: jax.Array) -> jax.Array:
            return jnp.sum(jnp.tanh(jax.lax.all_gather(x, "data", tiled=True) * w))

        return jax.grad(loss)(x)

    fn = jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    shape = (local[0] * mesh.size, *local[1:])
    x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P()))
    return sorted(set(KIND.findall(jax.jit(fn).lower(x, w).compile().as_text())))


def main() -> None:
    desc = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4")
    mesh = jax.sharding.Mesh(np.array(desc.devices), ("data",))
    for local in SHAPES:
        print(f"per device {list(local)!s:<14} {', '.join(kinds(mesh, local))}", flush=True)


if __name__ == "__main__":
    main()
