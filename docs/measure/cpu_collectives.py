"""What one collective costs on 8 CPU devices, alone: the yardstick for docs/strategies/overlap.md's
"On CPU" section, whose overlapped steps add collectives per layer.

    python docs/measure/cpu_collectives.py      # results/cpu_collectives.txt

Each program is one jitted ``shard_map`` over ``data=8`` on a float32 block per device
(64 KiB, 1 MiB, 4 MiB): the elementwise baseline, one permute (i -> i + 1), recursive
halving's three exchanges (i XOR 4, 2, 1), a reduce-scatter, an all-reduce and an all-gather.
Median of 30 waited-for calls after one, in milliseconds.
"""

import statistics
import time

import shardkit

shardkit.set_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

N = 8
MESH = jax.make_mesh((N,), ("data",))


def exchange(a: jax.Array, d: int) -> jax.Array:
    return jax.lax.ppermute(a, "data", [(i, i ^ d) for i in range(N)])


BODIES = {
    "elementwise": lambda a: a * 2,
    "permute": lambda a: jax.lax.ppermute(a, "data", [(i, (i + 1) % N) for i in range(N)]),
    "3 exchanges": lambda a: exchange(exchange(exchange(a, 4), 2), 1),
    "reduce-scatter": lambda a: jnp.tile(
        jax.lax.psum_scatter(a, "data", scatter_dimension=0, tiled=True), (N, 1)
    ),
    "all-reduce": lambda a: jax.lax.psum(a, "data"),
    "all-gather": lambda a: jax.lax.all_gather(a, "data", tiled=True)[: a.shape[0]],
}


def median_ms(fn, x: jax.Array, calls: int = 30) -> float:
    fn(x).block_until_ready()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    print(f"{N} CPU devices, median of 30 calls, ms")
    print(f"{'per device':<12}" + "".join(f"{name:>16}" for name in BODIES))
    for kib in (64, 1024, 4096):
        rows = kib * 1024 // 4 // 256
        x = jax.device_put(jnp.ones((N * rows, 256), jnp.float32), NamedSharding(MESH, P("data")))
        times = []
        for body in BODIES.values():
            fn = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("data"), out_specs=P("data")))
            times.append(median_ms(fn, x))
        print(f"{f'{kib} KiB':<12}" + "".join(f"{t:>16.2f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
