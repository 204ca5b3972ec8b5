"""Pipeline a model of your own: a deep residual MLP over a stage axis, any schedule.

Eight residual MLP layers cut into S·V chunks by ``ShardedModel``'s pipeline option
(``models.staged.Stages``: the embedding, one chunk's layers and the loss as three functions;
the schedule a table from ``parallel.pipeline.schedules``), microbatches split over ``data``;
verified against the plain model (``testing.compare_sharded``: loss, every gradient, one step),
the schedule printed, then trained with the model's own donated train step to fit a random
smooth target:

    python examples/pipeline_mlp.py [--schedule 1f1b] [--stages 4] [--micro 8] [--virtual 1]

The training loop waits for each step before the next: on XLA:CPU several in-flight
executions of one 8-device program can deadlock its in-process collectives (seen in CI: 4 of
8 device threads waiting forever at a collective-permute, the others queued behind them).
"""

import argparse

import shardkit

shardkit.set_cpu_devices(8)  # before any other JAX call

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardkit import ShardedModel, make_mesh, schedules, testing  # noqa: E402
from shardkit.models.staged import Stages  # noqa: E402

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


AXES = {  # logical names per dim: the stacked layer dim is "layers", split over stage
    "embed": (None, None),
    "layers": {"w1": ("layers", None, None), "w2": ("layers", None, None)},
    "head": (None, None),
}


def chunk_fn(w, x):  # one chunk: its layers under a scan
    return jax.lax.scan(lambda h, wl: (layer(wl, h), None), x, w)[0]


def microbatch_loss(p, y, target):  # this microbatch's share of the global mean
    return loss_of(p, y, target) / BATCH


def pipelined(data, schedule):
    """The model on a data × stage mesh: the layers over ``stage``, rows over ``data``."""
    mesh = make_mesh({"data": data, "stage": schedule.stages})
    rows = P("data") if data > 1 else P()
    stages = Stages(schedule, embed, chunk_fn, microbatch_loss, "layers", ("embed",), ("head",))
    return ShardedModel(mesh, AXES, {"layers": "stage"}, pipeline=stages,
                        batch_specs=(rows, rows))  # fmt: skip


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
    model = pipelined(data, schedule)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(BATCH, D_IN)), jnp.float32)
    y = jnp.sin(x.sum(axis=1, keepdims=True))

    def sharded(params, x, y):
        loss, grads = model.loss_and_grads(params, x, y)
        return loss, model.to_reference(grads)  # the layers back in your order

    check = testing.compare_sharded(
        sharded, twin_loss, init(0), *model.shard_batch(x, y), place=model.shard
    )
    check.assert_ok()
    print(f"pipelined == twin: worst {check.worst[0]} at {check.worst[1]:.1e}")

    optimizer = optax.adam(3e-3)
    params = model.shard(init(0))
    opt_state = model.init_opt_state(optimizer, params)
    step = model.train_step(optimizer)
    batch = model.shard_batch(x, y)
    for i in range(args.steps):
        params, opt_state, metrics = step(params, opt_state, *batch)
        jax.block_until_ready(metrics)  # one step in flight: see the module docstring
        if i == 0 or (i + 1) % 50 == 0:
            print(f"step {i + 1:4d}  loss {float(metrics['loss']):.5f}")
    print(f"(predicting the mean: loss {float(jnp.var(y)):.5f})")


if __name__ == "__main__":
    main()
