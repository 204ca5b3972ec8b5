"""shardkit.lm and the decoder options of shardkit.tensor, against plain-JAX twins.

RoPE against the complex-number rotation it is (and its relative-position property), packed
document positions by hand, the vocabulary split over ``model`` (embedding and cross-entropy,
values and gradients, pads ignored, logits never gathered), and a bias-free Llama block:
RMSNorm, RoPE at global positions, GQA with and without ``kv_repeat``, SwiGLU, plain and
Megatron-SP.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from shardkit import ledger
from shardkit.mesh import make_mesh
from shardkit.parallel import lm, tensor
from shardkit.parallel.sequence import attention_local, layouts
from shardkit.testing import assert_trees_close

TOL = 1e-5


@functools.cache
def mesh_of(data: int, model: int):
    return make_mesh({"data": data, "model": model})


def rng_normal(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ----------------------------------------------------------------------------- local pieces


def test_rope_is_the_complex_rotation_and_depends_on_relative_position() -> None:
    x = rng_normal(0, 2, 5, 3, 8)
    pos = np.array([0, 3, 7, 100, 4096], np.int32)
    got = np.asarray(lm.apply_rope(jnp.asarray(x), jnp.asarray(pos), theta=500.0))
    freqs = 500.0 ** (-np.arange(4) / 4)
    z = (x[..., :4] + 1j * x[..., 4:]) * np.exp(1j * pos[None, :, None, None] * freqs)
    np.testing.assert_allclose(got, np.concatenate([z.real, z.imag], -1), rtol=2e-5, atol=2e-5)
    # <rope(q, p + s), rope(k, p' + s)> does not depend on the shift s.
    q, k = rng_normal(1, 1, 1, 1, 8), rng_normal(2, 1, 1, 1, 8)
    dots = [
        float(np.sum(lm.apply_rope(q, jnp.array([3 + s])) * lm.apply_rope(k, jnp.array([1 + s]))))
        for s in (0, 10, 1000)
    ]
    assert dots == pytest.approx([dots[0]] * 3, rel=1e-4)


def test_document_positions_restart_at_each_document() -> None:
    segments = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5]])
    want = [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]]
    np.testing.assert_array_equal(lm.document_positions(segments), want)


def test_rms_norm_is_the_formula() -> None:
    x, scale = rng_normal(3, 2, 3, 8), rng_normal(4, 8)
    want = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * scale
    np.testing.assert_allclose(lm.rms_norm(jnp.asarray(x), jnp.asarray(scale)), want, rtol=1e-5)


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_local_positions_are_the_layouts_global_positions(layout: str) -> None:
    n, t = 4, 6
    fn = jax.shard_map(
        lambda: layouts.local_positions(layout, "model", t)[None],
        mesh=mesh_of(1, n), in_specs=(), out_specs=P("model"),
    )  # fmt: skip
    np.testing.assert_array_equal(jax.jit(fn)(), layouts.positions(layout, n, t))


# ----------------------------------------------------------------------------- vocabulary

B, T, D, V = 4, 8, 16, 32


def vocab_inputs() -> dict:
    rng = np.random.default_rng(5)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    targets[0, :2] = targets[3, 5] = lm.IGNORE  # padded targets
    return {
        "ids": rng.integers(0, V, (B, T)).astype(np.int32),
        "targets": targets,
        "table": rng_normal(6, V, D),
        "head": rng_normal(7, D, V) / 4,
    }


def vocab_twin(p: dict, ids, targets) -> jax.Array:
    h = jnp.tanh(p["table"][ids])
    logits = h @ p["head"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0))
    return jnp.where(targets >= 0, ce, 0.0).sum() / (targets >= 0).sum().astype(jnp.float32)


def vocab_sharded(data: int, model: int, token_dim: int | None):
    """Batch over data, vocabulary over model; Megatron-SP keeps tokens split between."""
    mesh = mesh_of(data, model)

    def body(p, ids, targets):
        h = jnp.tanh(lm.vocab_embed(ids, p["table"], "model", token_dim=token_dim))
        logits = lm.vocab_logits(h, p["head"], "model", token_dim=token_dim)
        ce = lm.vocab_cross_entropy(logits, targets, "model")
        count = jax.lax.psum(lm.valid_count(targets), "data")
        return jax.lax.psum(ce.sum(), "data") / count

    specs = {"table": P("model", None), "head": P(None, "model")}
    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=P())
    return jax.jit(jax.value_and_grad(fn)), specs


@pytest.mark.parametrize(("data", "model", "token_dim"), [(2, 4, None), (1, 4, 1), (2, 2, None)])
def test_vocab_parallel_loss_equals_the_twin_and_never_gathers_logits(data, model, token_dim):
    x = vocab_inputs()
    p = {"table": x["table"], "head": x["head"]}
    fn, _ = vocab_sharded(data, model, token_dim)
    loss, grads = fn(p, x["ids"], x["targets"])
    want_loss, want_grads = jax.value_and_grad(vocab_twin)(p, x["ids"], x["targets"])
    assert float(loss) == pytest.approx(float(want_loss), rel=TOL)
    assert_trees_close(grads, want_grads, TOL)
    # The logits [B, T, V] never travel: no all-gather over model bigger than a [B, T, D]
    # activation, and the loss's reductions are [B, T] floats.
    led = ledger.measure(fn, p, x["ids"], x["targets"], mesh=mesh_of(data, model))
    for c in led.select("all-gather"):
        assert c.total_bytes_sent <= B * T * D * 4, c


def test_vocab_embed_places_each_row_once() -> None:
    x = vocab_inputs()
    fn = jax.shard_map(
        lambda ids, table: lm.vocab_embed(ids, table, "model"),
        mesh=mesh_of(1, 4), in_specs=(P(), P("model")), out_specs=P(),
    )  # fmt: skip
    np.testing.assert_array_equal(jax.jit(fn)(x["ids"], x["table"]), x["table"][x["ids"]])


# ----------------------------------------------------------------------------- Llama block

H, HKV, K, F = 8, 2, 4, 24


def block_params(seed: int) -> dict:
    r = lambda i, *s: rng_normal(seed + i, *s) / np.sqrt(s[0])  # noqa: E731
    return {
        "norm1": 1 + 0.1 * rng_normal(seed, D),
        "norm2": 1 + 0.1 * rng_normal(seed + 9, D),
        "attn": {
            "query": {"kernel": r(1, D, H, K)},
            "key": {"kernel": r(2, D, HKV, K)},
            "value": {"kernel": r(3, D, HKV, K)},
            "out": {"kernel": r(4, H, K, D)},
        },
        "mlp": {
            "gate": {"kernel": r(5, D, F)},
            "up": {"kernel": r(6, D, F)},
            "down": {"kernel": r(7, F, D)},
        },
    }


def block_twin(p: dict, x: jax.Array, pos: jax.Array) -> jax.Array:
    a = p["attn"]
    h = lm.rms_norm(x, p["norm1"])
    q, k, v = (jnp.einsum("btd,dhk->bthk", h, a[n]["kernel"]) for n in ("query", "key", "value"))
    q, k = lm.apply_rope(q, pos), lm.apply_rope(k, pos)
    k, v = (jnp.repeat(z, H // HKV, axis=2) for z in (k, v))
    s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(K)
    s = jnp.where(jnp.tril(jnp.ones((x.shape[1],) * 2, bool)), s, -jnp.inf)
    o = jnp.einsum("bhts,bshk,hkd->btd", jax.nn.softmax(s, -1), v, a["out"]["kernel"])
    x = x + o
    m, h = p["mlp"], lm.rms_norm(x, p["norm2"])
    z = jax.nn.silu(h @ m["gate"]["kernel"]) * (h @ m["up"]["kernel"])
    return x + z @ m["down"]["kernel"]


def block_sharded(model: int, kv_repeat: bool, token_dim: int | None):
    """Heads, MLP hidden over model; KV heads split (h_kv ≥ n) or whole (``kv_repeat``)."""
    kv = P() if kv_repeat else P(None, "model")
    specs = {
        "norm1": P(), "norm2": P(),
        "attn": {"query": {"kernel": P(None, "model")}, "key": {"kernel": kv},
                 "value": {"kernel": kv}, "out": {"kernel": P("model")}},
        "mlp": {"gate": {"kernel": P(None, "model")}, "up": {"kernel": P(None, "model")},
                "down": {"kernel": P("model")}},
    }  # fmt: skip

    def core(q, k, v):
        return attention_local(q, k, v, causal=True)[0]

    def body(p, x, pos):
        hook = lm.rope(pos)
        h = lm.rms_norm(x, p["norm1"])
        x = x + tensor.attention_tp(
            h, p["attn"], "model", core, token_dim=token_dim, rope=hook, kv_repeat=kv_repeat
        )
        return x + tensor.gated_mlp_tp(lm.rms_norm(x, p["norm2"]), p["mlp"], "model",
                                       token_dim=token_dim)  # fmt: skip

    x_spec = P(None, "model") if token_dim else P()
    return jax.shard_map(
        body, mesh=mesh_of(1, model), in_specs=(specs, x_spec, P()), out_specs=x_spec
    )


@pytest.mark.parametrize(
    ("model", "kv_repeat", "token_dim"), [(2, False, None), (4, True, None), (4, True, 1)]
)
def test_llama_block_equals_its_twin(model: int, kv_repeat: bool, token_dim: int | None) -> None:
    """RMSNorm, RoPE at positions 5.. (not 0..: the hook must use what it is given), GQA 8/2,
    SwiGLU, no bias; values and every gradient."""
    p, x = block_params(10), rng_normal(20, 2, 8, D)
    pos = jnp.arange(5, 13, dtype=jnp.int32)
    w = rng_normal(30, 2, 8, D)

    def loss(fn):
        return lambda p, x: jnp.sum(jnp.sin(fn(p, x, pos)) * w)

    sharded = block_sharded(model, kv_repeat, token_dim)
    got = jax.jit(jax.value_and_grad(loss(sharded), argnums=(0, 1)))(p, x)
    want = jax.value_and_grad(loss(block_twin), argnums=(0, 1))(p, x)
    assert_trees_close(got, want, TOL)


def test_kv_repeat_refuses_a_degree_that_is_no_multiple_of_the_kv_heads() -> None:
    p = block_params(10)
    p["attn"]["key"]["kernel"] = p["attn"]["value"]["kernel"] = rng_normal(1, D, 3, K)
    fn = block_sharded(4, True, None)
    with pytest.raises(ValueError, match=r"kv_repeat needs more devices on 'model' \(4\) than KV"):
        jax.jit(fn).lower(p, rng_normal(2, 2, 8, D), jnp.arange(8))
