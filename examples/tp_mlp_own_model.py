"""Your own model, sharded by hand: a tiny transformer block on a data × model mesh.

shardkit's primitives assume no ViT. Here a user's regression model -- one pre-LN transformer
block (attention + MLP) and a linear readout -- runs on ``data=4 × model=2`` (8 CPU devices):

  * tensor parallelism over ``model``: ``tensor.attention_tp`` (heads split) and
    ``tensor.mlp_tp`` (hidden width split), each one Megatron region with ONE all-reduce
    forward and one backward;
  * data parallelism over ``data``: ``data.vary`` before the loss, ``data.sync_grads`` after,
    so the gradient all-reduce is explicit (one bucket) instead of hidden in autodiff.

It is then checked against an unsharded twin written in plain ``jnp`` (loss and every gradient
leaf, relative L2 ≤ 1e-5) and the collectives of the compiled step are listed.

    python examples/tp_mlp_own_model.py [--batch 8 --tokens 12 --dim 32 --heads 4 --mlp 64]
"""

import argparse

import shardkit

shardkit.set_cpu_devices(8)  # before any other JAX call: the backend fixes its device count once

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardkit import data, ledger, sequence, tensor, testing  # noqa: E402

MESH = {"data": 4, "model": 2}

# Where each weight lives, declared once. Column-parallel weights (q/k/v, fc1) and their biases
# are split over model along heads / hidden; row-parallel weights (out, fc2) along their input
# dim, their biases whole (added once, after the reduction). LayerNorm and readout: replicated.
COLUMN = {"kernel": P(None, "model"), "bias": P("model")}  # fc1: W[D, F_model], b[F_model]
HEADS = {"kernel": P(None, "model", None), "bias": P("model", None)}  # W[D, H_model, K]
ROW = {"kernel": P("model"), "bias": P()}  # out: W[H_model, K, D], fc2: W[F_model, D]; b[D]
LAYER_NORM = {"scale": P(), "bias": P()}
SPECS = {
    "ln1": LAYER_NORM,
    "attn": {"query": HEADS, "key": HEADS, "value": HEADS, "out": ROW},
    "ln2": LAYER_NORM,
    "mlp": {"fc1": COLUMN, "fc2": ROW},
    "readout": {"kernel": P(), "bias": P()},
}


def init(rng: np.random.Generator, d: int, h: int, f: int) -> dict:
    """Random, non-degenerate params: every leaf, biases included, affects the loss."""
    k = d // h
    shapes = {
        "ln1": {"scale": (d,), "bias": (d,)},
        "attn": {
            **{name: {"kernel": (d, h, k), "bias": (h, k)} for name in ("query", "key", "value")},
            "out": {"kernel": (h, k, d), "bias": (d,)},
        },
        "ln2": {"scale": (d,), "bias": (d,)},
        "mlp": {"fc1": {"kernel": (d, f), "bias": (f,)}, "fc2": {"kernel": (f, d), "bias": (d,)}},
        "readout": {"kernel": (d,), "bias": ()},
    }
    # Matrices: std 1/sqrt(fan_in). Vectors (biases, LayerNorm scales): std 0.5, not 0 or 1,
    # so a forgotten bias or scale shows up as an error, not as a vacuous match. (numpy draws
    # them: eager jax.random would compile once per shape.)
    draw = lambda s: rng.normal(0, s[0] ** -0.5 if len(s) > 1 else 0.5, s).astype(np.float32)  # noqa: E731
    return jax.tree.map(draw, shapes, is_leaf=lambda s: isinstance(s, tuple))


def layer_norm(x: jax.Array, p: dict) -> jax.Array:
    x = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-6)
    return x * p["scale"] + p["bias"]


# ----------------------------------------------------------------------------- unsharded twin


def predict_ref(p: dict, x: jax.Array) -> jax.Array:
    """x[b, t, d] -> y[b]: a pre-LN block, mean over tokens, linear readout. Plain jnp."""
    h = layer_norm(x, p["ln1"])
    q, k, v = (
        jnp.einsum("btd,dhk->bthk", h, p["attn"][n]["kernel"]) + p["attn"][n]["bias"]
        for n in ("query", "key", "value")
    )
    logits = jnp.einsum("bqhk,bshk->bhqs", q, k) / q.shape[-1] ** 0.5
    o = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(logits, -1), v)
    x = x + jnp.einsum("bthk,hkd->btd", o, p["attn"]["out"]["kernel"]) + p["attn"]["out"]["bias"]
    h = jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["mlp"]["fc1"]["kernel"] + p["mlp"]["fc1"]["bias"])
    x = x + h @ p["mlp"]["fc2"]["kernel"] + p["mlp"]["fc2"]["bias"]
    return x.mean(1) @ p["readout"]["kernel"] + p["readout"]["bias"]


def loss_ref(p: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(predict_ref(p, x) - y))


# ----------------------------------------------------------------------------- sharded


def predict_local(p_frag: dict, x_block: jax.Array) -> jax.Array:
    """The same model on one device: x[B_data, T, D] and weight fragments -> y[B_data]."""

    def core(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        # Attention on this device's heads (no communication); swap in sequence.attention_ring
        # here to split tokens over a seq axis as well.
        return sequence.attention_local(q, k, v)[0]

    # One Megatron region each: f (enter) ... column ... row ... g (psum over model).
    h = layer_norm(x_block, p_frag["ln1"])
    x = x_block + tensor.attention_tp(h, p_frag["attn"], "model", core)
    h = layer_norm(x, p_frag["ln2"])
    x = x + tensor.mlp_tp(h, p_frag["mlp"], "model", jax.nn.gelu)
    return x.mean(1) @ p_frag["readout"]["kernel"] + p_frag["readout"]["bias"]


def loss_and_grads_local(p_frag: dict, x_block: jax.Array, y_block: jax.Array):
    """One shard_map body: local loss, gradients, explicit DP gradient all-reduce."""
    global_batch = x_block.shape[0] * jax.lax.axis_size("data")
    # Every weight's gradient is a partial sum over data (each device saw B/4 examples).
    sync_axes = jax.tree.map(lambda _: ("data",), p_frag)

    def loss_local(p: dict) -> jax.Array:
        return jnp.sum(jnp.square(predict_local(p, x_block) - y_block)) / global_batch

    # vary: params typed varying over data, so autodiff leaves dw{U_data} unreduced ...
    loss, grads = jax.value_and_grad(loss_local)(data.vary(p_frag, sync_axes))
    # ... and sync_grads all-reduces it here: dw{U_data} -> dw, one psum per bucket.
    grads = data.sync_grads(grads, sync_axes)
    return jax.lax.psum(loss, "data"), grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="divisible by data=4")
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4, help="divisible by model=2")
    parser.add_argument("--mlp", type=int, default=64, help="divisible by model=2")
    args = parser.parse_args()

    mesh = shardkit.make_mesh(MESH)
    rng = np.random.default_rng(0)
    params = init(rng, args.dim, args.heads, args.mlp)
    x = rng.normal(size=(args.batch, args.tokens, args.dim)).astype(np.float32)
    y = rng.normal(size=(args.batch,)).astype(np.float32)

    batch_spec = P("data")
    step = jax.jit(
        jax.shard_map(
            loss_and_grads_local,
            mesh=mesh,
            in_specs=(SPECS, batch_spec, batch_spec),
            out_specs=(P(), SPECS),  # loss replicated; each gradient sharded like its param
        )
    )
    place = lambda tree, specs: jax.device_put(  # noqa: E731
        tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    )
    args_sharded = (place(params, SPECS), *place((x, y), (batch_spec, batch_spec)))
    loss, grads = step(*args_sharded)
    loss_want, grads_want = jax.jit(jax.value_and_grad(loss_ref))(params, x, y)

    print(
        f"mesh {shardkit.mesh.format_mesh(MESH)}: loss sharded {float(loss):.6f}, "
        f"unsharded {float(loss_want):.6f}"
    )
    loss_err = testing.max_error(loss, loss_want)
    grad_path, grad_err = testing.worst_leaf(testing.tree_errors(grads, grads_want))
    print(f"relative L2 error: loss {loss_err:.2e}, worst gradient leaf {grad_path} {grad_err:.2e}")
    testing.assert_trees_close(loss, loss_want, what="loss")
    testing.assert_trees_close(grads, grads_want, what="gradients")
    print("sharded == unsharded (loss and every gradient leaf within 1e-5)")

    # What moves: 4 all-reduces over model -- forward the g after attention and after the MLP,
    # backward the f before q/k/v (one, not three) and before fc1 -- and over data the gradient
    # buckets of sync_grads plus the loss psum, which XLA combined into ONE all-reduce here.
    print(ledger.format_table(ledger.measure(step, *args_sharded)))


if __name__ == "__main__":
    main()
