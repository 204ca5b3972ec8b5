"""Pipeline a model of your own: a deep residual MLP over a stage axis, any schedule.

Eight residual MLP layers cut into S·V chunks (``parallel.pipeline``'s engine; the schedule a
table from ``parallel.schedules``), microbatches split over ``data``; verified against the
plain model (``testing.compare_sharded``: loss, every gradient, one step), the schedule
printed, then trained to fit a random smooth target:

    python examples/pipeline_mlp.py [--schedule 1f1b] [--stages 4] [--micro 8] [--virtual 1]
"""

import argparse

import shardkit

shardkit.set_cpu_devices(8)  # before any other JAX call

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardkit import pipeline, schedules, testing  # noqa: E402

LAYERS, WIDTH, HIDDEN, D_IN, BATCH = 8, 16, 32, 4, 32


def init(seed):
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "embed": jax.random.normal(k[0], (D_IN, WIDTH)) / np.sqrt(D_IN),
        "layers": {"w1": jax.random.normal(k[1], (LAYERS, WIDTH, HIDDEN)) / np.sqrt(WIDTH),
                   "w2": jax.random.normal(k[2], (LAYERS, HIDDEN, WIDTH)) / np.sqrt(HIDDEN)},
        "head": jax.random.normal(k[3], (WIDTH, 1)) / np.sqrt(WIDTH),
    }  # fmt: skip


def layer(w, x):
    return x + jnp.tanh(x @ w["w1"]) @ w["w2"] / LAYERS


def embed(p, raw):
    return jnp.tanh(raw @ p["embed"])


def loss_of(p, y, target):  # summed squared error; divided by the batch outside
    return jnp.sum((y @ p["head"] - target) ** 2)


def twin_loss(p, x, y):
    h, _ = jax.lax.scan(lambda h, w: (layer(w, h), None), embed(p, x), p["layers"])
    return loss_of(p, h, y) / x.shape[0]


def pipelined(mesh, schedule):
    """(params, x, y) -> (loss, grads) with the layers over ``stage``, rows over ``data``."""
    s, v, m = schedule.stages, schedule.virtual, schedule.micro
    per_chunk = LAYERS // (s * v)

    def chunk_fn(w, x):  # one chunk: its layers under a scan
        return jax.lax.scan(lambda h, wl: (layer(wl, h), None), x, w)[0]

    def body(chunks, ends_params, x, y):
        split = lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:])  # noqa: E731
        ends = pipeline.Ends(embed, ends_params, loss_of, ends_params)
        loss, grads, d_embed, d_head = pipeline.pipeline_grads(
            schedule, chunk_fn, chunks, ends, split(x), split(y)
        )
        total = BATCH
        d_ends = jax.tree.map(jnp.add, d_embed, d_head)
        return jax.lax.psum((loss / total, jax.tree.map(lambda g: g / total, (grads, d_ends))),
                            "data")  # fmt: skip

    def run(params, x, y):
        # Device s holds chunks s, s+S, ...: [L] -> [S·V, per_chunk] in that order.
        order = np.array([c * s + d for d in range(s) for c in range(v)])
        chunks = jax.tree.map(lambda a: a.reshape(s * v, per_chunk, *a.shape[1:])[order],
                              params["layers"])  # fmt: skip
        ends_params = {k: params[k] for k in ("embed", "head")}
        step = jax.shard_map(body, mesh=mesh, in_specs=(P("stage"), P(), P("data"), P("data")),
                             out_specs=(P(), (P("stage"), P())))  # fmt: skip
        loss, (grads, d_ends) = step(chunks, ends_params, x, y)
        back = np.argsort(order)
        layers = jax.tree.map(lambda g: g[back].reshape(LAYERS, *g.shape[2:]), grads)
        return loss, {"layers": layers, **d_ends}

    return jax.jit(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=schedules.SCHEDULES)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--virtual", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    schedule = schedules.build(args.schedule, args.stages, args.micro, args.virtual)
    data = 8 // args.stages
    rows = BATCH // data
    if LAYERS % (args.stages * args.virtual) or rows % args.micro:
        parser.error(
            f"{LAYERS} layers must split into {args.stages}×{args.virtual} chunks and {rows} "
            f"rows per data shard into {args.micro} microbatches"
        )
    print(schedule)
    devices = np.asarray(jax.devices()[: data * args.stages], dtype=object)
    mesh = Mesh(devices.reshape(data, args.stages), ("data", "stage"))
    step_fn = pipelined(mesh, schedule)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(BATCH, D_IN)), jnp.float32)
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    check = testing.compare_sharded(step_fn, twin_loss, init(0), x, y)
    check.assert_ok()
    print(f"pipelined == twin: worst {check.worst[0]} at {check.worst[1]:.1e}")

    optimizer = optax.adam(3e-3)
    params = init(0)
    state = optimizer.init(params)
    for i in range(args.steps):
        loss, grads = step_fn(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        if i == 0 or (i + 1) % 50 == 0:
            print(f"step {i + 1:4d}  loss {float(loss):.5f}")
    print(f"(predicting the mean: loss {float(jnp.var(y)):.5f})")


if __name__ == "__main__":
    main()
