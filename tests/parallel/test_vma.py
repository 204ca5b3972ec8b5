"""vma.checked_block: a residual block whose output varies over an axis its input did not (a
row-parallel partial sum left unreduced) is named at trace time, in one sentence, under scan
and unrolled; a correct block passes through unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardkit.mesh import make_mesh
from shardkit.parallel import tensor, vma

MESH = make_mesh({"data": 2, "model": 4})
D, F = 8, 16


def _params() -> dict:
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    return {"fc1": {"kernel": w(3, D, F)}, "fc2": {"kernel": w(3, F, D)}}


def _run(block, layers: str) -> jax.Array:
    specs = {"fc1": {"kernel": P(None, None, "model")}, "fc2": {"kernel": P(None, "model", None)}}

    def body(x, p):
        if layers == "scan":
            return jax.lax.scan(block, x, p)[0]
        for i in range(3):
            x, _ = block(x, jax.tree.map(lambda a, i=i: a[i], p))
        return x

    f = jax.shard_map(body, mesh=MESH, in_specs=(P("data"), specs), out_specs=P("data"))
    return jax.jit(f)(jnp.ones((4, 5, D)), _params())


@vma.checked_block
def good_block(x, p):
    h = tensor.enter_tp(x, "model")
    y = jax.nn.gelu(h @ p["fc1"]["kernel"]) @ p["fc2"]["kernel"]
    return x + tensor.exit_tp(y, "model"), None


@vma.checked_block
def forgot_exit_tp(x, p):
    h = tensor.enter_tp(x, "model")
    y = jax.nn.gelu(h @ p["fc1"]["kernel"]) @ p["fc2"]["kernel"]
    return x + y, None  # the row-parallel partial sum, never reduced


@pytest.mark.parametrize("layers", ["scan", "unrolled"])
def test_an_unreduced_row_parallel_output_is_named_at_its_block(layers: str) -> None:
    with pytest.raises(vma.UnreducedError) as err:
        _run(forgot_exit_tp, layers)
    message = str(err.value)
    assert message.startswith("forgot_exit_tp returns a value varying over 'model'")
    assert "tensor.exit_tp" in message and message.count(". ") == 0


@pytest.mark.parametrize("layers", ["scan", "unrolled"])
def test_a_reduced_block_runs_unchanged(layers: str) -> None:
    assert np.isfinite(np.asarray(_run(good_block, layers))).all()
