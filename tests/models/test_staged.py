"""shardkit.models.staged: any model pipelined through ShardedModel's pipeline option equals
its unsharded twin (loss, every gradient, one step) — schedules, virtual chunks, FSDP, a tied
end — and each misuse is one sentence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardkit import ShardedModel, make_mesh, testing
from shardkit.mesh import PlanError
from shardkit.models.staged import Stages
from shardkit.parallel.pipeline import schedules

LAYERS, WIDTH, BATCH = 4, 8, 8
AXES = {"embed": (None, "embed"), "layers": ("layers", "embed", None), "head": ("embed", None)}


def init(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "embed": jax.random.normal(k[0], (3, WIDTH)) / np.sqrt(3),
        "layers": jax.random.normal(k[1], (LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH),
        "head": jax.random.normal(k[2], (WIDTH, 1)) / np.sqrt(WIDTH),
    }


def embed(p, x):
    return jnp.tanh(x @ p["embed"])


def chunk(w, h):
    return jax.lax.scan(lambda h, wl: (h + jnp.tanh(h @ wl), None), h, w)[0]


def loss(p, h, y):
    return jnp.sum((h @ p["head"] - y) ** 2) / BATCH


def tied_loss(p, h, y):
    """The head reads the embedding matrix too (a tied end)."""
    out = h @ p["head"] + 0.1 * (h @ p["embed"].T).sum(axis=1, keepdims=True)
    return jnp.sum((out - y) ** 2) / BATCH


def twin(p, x, y):
    return loss(p, chunk(p["layers"], embed(p, x)), y)


def tied_twin(p, x, y):
    return tied_loss(p, chunk(p["layers"], embed(p, x)), y)


def _model(pp: str, data: int, stages: int, micro: int, virtual: int = 1, **kw) -> ShardedModel:
    sched = schedules.build(pp, stages, micro, virtual)
    rows = P("data") if data > 1 else P()
    head = kw.pop("head", ("head",))
    spec = Stages(sched, embed, chunk, loss, "layers", ("embed",), head)
    mesh = make_mesh({"data": data, "stage": stages})
    rules = {"layers": "stage", **kw.pop("rules", {})}
    return ShardedModel(mesh, AXES, rules, pipeline=spec, batch_specs=(rows, rows), **kw)


CASES = [
    ("gpipe", dict(data=2, stages=2, micro=2)),
    ("1f1b", dict(data=1, stages=4, micro=4)),
    ("interleaved", dict(data=2, stages=2, micro=2, virtual=2)),
    ("zb", dict(data=2, stages=2, micro=2, rules={"embed": "data"})),  # FSDP over data
    ("1f1b", dict(data=2, stages=2, micro=2, rules={"embed": "data"}, zero=1)),
]


@pytest.mark.parametrize(("pp", "kw"), CASES)
def test_a_pipelined_model_equals_its_twin(pp: str, kw: dict) -> None:
    model = _model(pp, **kw)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(BATCH, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(BATCH, 1)), jnp.float32)

    def sharded(p, x, y):
        value, grads = model.loss_and_grads(p, x, y)
        return value, model.to_reference(grads)

    check = testing.compare_sharded(sharded, twin, init(), *model.shard_batch(x, y),
                                    place=model.shard)  # fmt: skip
    check.assert_ok()


def test_a_tied_end_sums_both_gradients() -> None:
    """``embed`` read by the embedding and by the head: its gradient is the sum of both."""
    sched = schedules.build("1f1b", 2, 2)
    spec = Stages(sched, embed, chunk, tied_loss, "layers", ("embed",), ("head", "embed"))
    model = ShardedModel(make_mesh({"stage": 2}), AXES, {"layers": "stage"}, pipeline=spec,
                         batch_specs=(P(), P()))  # fmt: skip
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(BATCH, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(BATCH, 1)), jnp.float32)
    check = testing.compare_sharded(
        model.loss_and_grads, tied_twin, init(), *model.shard_batch(x, y), place=model.shard
    )
    check.assert_ok()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: _model("1f1b", data=2, stages=2, micro=2, zero=2, rules={"embed": "data"}),
         "ZeRO-2 cannot run under a pipeline"),
        (lambda: ShardedModel(make_mesh({"stage": 4}), AXES, {"layers": "stage"},
                              pipeline=_model("gpipe", 1, 2, 2).pipeline),
         "The schedule has 2 stages but the mesh's 'stage' axis has 4 devices"),
        (lambda: ShardedModel(make_mesh({"stage": 2}), AXES, {"layers": "stage"},
                              pipeline=_model("gpipe", 1, 2, 2).pipeline),
         r"A pipelined model takes at least two batch inputs \(inputs, targets, \*side\), not 1"),
        (lambda: ShardedModel(make_mesh({"stage": 2}), AXES, {"layers": "stage"}),
         "Give loss_local"),
    ],
)  # fmt: skip
def test_misuse_is_one_sentence(make, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        make()
