"""A tour of every collective: what each device holds before and after, and what the HLO sends.

On 4 CPU devices along the mesh axis ``model``, each device starts with its own small integer
block. Every collective of ``shardkit.collectives`` runs in its own ``shard_map``; the script
prints each device's block before and after, checks each ring / bidirectional version (built
only from ``ppermute``) equal to the built-in it replaces, exactly, and prints the bytes per
device that ``shardkit.ledger`` measured in the compiled HLO next to the ring formula:

    python examples/collectives_tour.py            # 4 devices
    python examples/collectives_tour.py --devices 3 --width 6
"""

import argparse
import sys

import shardkit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=4, help="devices on the axis (default 4)")
parser.add_argument("--width", type=int, default=4, help="elements per device; a multiple of n")
ARGS = parser.parse_args()
shardkit.set_cpu_devices(ARGS.devices)  # before any other JAX call

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardkit import collectives as c  # noqa: E402
from shardkit import ledger  # noqa: E402

N, W, AXIS = ARGS.devices, ARGS.width, "model"
MESH = shardkit.make_mesh({AXIS: N})
# x[I_model]: device i holds [i*W, i*W + 1, ..., i*W + W-1] (one row of the [N, W] global array).
X = jnp.arange(N * W, dtype=jnp.int32).reshape(N, W)
V = W * 4  # bytes of one device's block (int32)

# name, per-device body, (its built-in twin or None), ring formula for the bytes each device sends
TOUR = [
    ("all_reduce (psum)", lambda x: c.all_reduce(x, AXIS), None, 2 * (N - 1) / N * V),
    ("ring_all_reduce", lambda x: c.ring_all_reduce(x, AXIS), "all_reduce (psum)",
     2 * (N - 1) / N * V),
    ("bidir_all_reduce", lambda x: c.bidir_all_reduce(x, AXIS), "all_reduce (psum)",
     2 * (N - 1) / N * V),
    ("all_gather", lambda x: c.all_gather(x, AXIS, axis_dim=0, tiled=True), None, (N - 1) * V),
    ("ring_all_gather", lambda x: c.ring_all_gather(x, AXIS, axis_dim=0, tiled=True),
     "all_gather", (N - 1) * V),
    ("bidir_all_gather", lambda x: c.bidir_all_gather(x, AXIS, axis_dim=0, tiled=True),
     "all_gather", (N - 1) * V),
    ("reduce_scatter", lambda x: c.reduce_scatter(x, AXIS, scatter_dim=0, tiled=True), None,
     (N - 1) / N * V),
    ("ring_reduce_scatter", lambda x: c.ring_reduce_scatter(x, AXIS, scatter_dim=0, tiled=True),
     "reduce_scatter", (N - 1) / N * V),
    ("bidir_reduce_scatter",
     lambda x: c.bidir_reduce_scatter(x, AXIS, scatter_dim=0, tiled=True), "reduce_scatter",
     (N - 1) / N * V),
    ("ring_shift (+1)", lambda x: c.ring_shift(x, AXIS, 1), None, V),
    ("all_to_all", lambda x: c.all_to_all(x, AXIS, split_axis=0, concat_axis=0, tiled=True),
     None, (N - 1) / N * V),
]  # fmt: skip


def run(body):
    """(jitted shard_map of body over rows of X, its output on X)."""
    # Results that psum makes invariant still come back per device: out_specs keeps the axis.
    fn = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P(AXIS), out_specs=P(AXIS)))
    return fn, np.asarray(fn(X))


def rows(a: np.ndarray) -> str:
    per_device = np.split(a, N)
    return "  ".join(f"d{i}:{r.ravel().tolist()}" for i, r in enumerate(per_device))


def main() -> int:
    if W % N:
        print(f"error: --width {W} must be a multiple of --devices {N}.", file=sys.stderr)
        return 2
    print(f"mesh {AXIS}={N}; each device holds {W} int32 ({V} bytes)")
    print(f"before: {rows(np.asarray(X))}\n")
    outputs, ok = {}, True
    for name, body, twin, formula in TOUR:
        fn, out = run(lambda x, body=body: body(x[0])[None])
        outputs[name] = out
        sent = ledger.measure(fn, X, mesh=MESH).total_bytes_sent()
        same = "" if twin is None else f"  == {twin}: {np.array_equal(out, outputs[twin])}"
        ok &= twin is None or np.array_equal(out, outputs[twin])
        ok &= abs(sent - formula) <= 0.01 * formula
        print(f"{name:<22} sent {sent:>6.0f} B/device (formula {formula:>6.0f}){same}")
        print(f"    after: {rows(out)}")
    print("\nall ring / bidirectional collectives == built-ins and bytes == formulas:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
