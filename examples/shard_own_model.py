"""Shard your own model: plain JAX -> verified, contract-checked, trained on data × seq × model.

A user's per-token regression encoder (embedding, two pre-LN attention + MLP blocks under
``lax.scan``, a linear readout; every token predicts the mean of its sequence, so attention
must see every key) run by ``shardkit.ShardedModel``: heads and MLP hidden split over
``model`` (``tensor``), tokens over ``seq`` (``sequence.attention_ring``), the batch over
``data``. Only public API. Checked against its unsharded twin (``testing.compare_sharded``:
loss, every gradient leaf, one AdamW step), held to a contract written from the formulas
(``comm.contract``), then trained:

    python examples/shard_own_model.py [--mesh data=2,seq=2,model=2] [--steps 150]

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

from shardkit import ShardedModel, sequence, tensor, testing  # noqa: E402
from shardkit.comm import contract  # noqa: E402

DIMS = {"batch": 8, "tokens": 16, "d_in": 4, "dim": 32, "heads": 4, "mlp": 64, "layers": 2}


# --8<-- [start:axes]
def param_axes(layers):
    """Logical names per dim of every leaf: one table (RULES) maps them to mesh axes."""
    dense = lambda i, o: {"kernel": (i, o), "bias": (o,)}  # noqa: E731
    proj = {"kernel": ("embed", "heads", "head_dim"), "bias": ("heads", "head_dim")}
    block = {"ln1": ("embed",), "ln2": ("embed",),
             "attn": {"query": proj, "key": proj, "value": proj,
                      "out": {"kernel": ("heads", "head_dim", "embed"), "bias": ("embed",)}},
             "mlp": {"fc1": dense("embed", "mlp"), "fc2": dense("mlp", "embed")}}  # fmt: skip
    stacked = jax.tree.map(lambda n: ("layers", *n), block, is_leaf=lambda x: isinstance(x, tuple))
    return {"embed": dense("d_in", "embed"), "blocks": stacked, "readout": dense("embed", "d_in")}


RULES = {"heads": "model", "mlp": "model"}  # add "embed": "data" for FSDP
# --8<-- [end:axes]


def init(seed, d_in, dim, heads, mlp, layers):
    """Random, non-degenerate params (biases too) of the shapes ``param_axes`` names."""
    sizes = {"d_in": d_in, "embed": dim, "heads": heads, "head_dim": dim // heads, "mlp": mlp,
             "layers": layers}  # fmt: skip
    axes = param_axes(layers)
    names, tree = jax.tree.flatten(axes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(seed), len(names))

    def leaf(key, ns):
        dims = [n for n in ns if n != "layers"]
        noise = jax.random.normal(key, [sizes[n] for n in ns])
        return noise / np.sqrt(sizes[dims[0]]) if len(dims) > 1 else 0.1 * noise

    params = jax.tree.unflatten(tree, [leaf(k, ns) for k, ns in zip(keys, names, strict=True)])
    for b in ("ln1", "ln2"):  # norm scales around 1
        params["blocks"][b] = params["blocks"][b] + 1.0
    return params


# --8<-- [start:twin]
def norm(x, scale):
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale


def twin_loss(p, x, y):
    """The unsharded model in plain jnp: mean squared error of every token's prediction."""

    def attention(h, a):
        q, k, v = (jnp.einsum("btd,dhk->bthk", h, a[n]["kernel"]) + a[n]["bias"]
                   for n in ("query", "key", "value"))  # fmt: skip
        w = jax.nn.softmax(jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1]), axis=-1)
        return jnp.einsum("bhts,bshk,hkd->btd", w, v, a["out"]["kernel"]) + a["out"]["bias"]

    def block(h, b):
        h = h + attention(norm(h, b["ln1"]), b["attn"])
        z = jax.nn.gelu(norm(h, b["ln2"]) @ b["mlp"]["fc1"]["kernel"] + b["mlp"]["fc1"]["bias"])
        return h + z @ b["mlp"]["fc2"]["kernel"] + b["mlp"]["fc2"]["bias"], None

    h, _ = jax.lax.scan(block, x @ p["embed"]["kernel"] + p["embed"]["bias"], p["blocks"])
    return jnp.mean((h @ p["readout"]["kernel"] + p["readout"]["bias"] - y) ** 2)


# --8<-- [end:twin]


# --8<-- [start:sharded]
def sharded_model(mesh):
    """The same model on ``mesh``: x, y[B_data, T_seq, d_in]; heads and hidden over model."""
    tp = "model" if mesh.shape["model"] > 1 else None
    ring = mesh.shape["seq"] > 1

    def core(q, k, v):  # local heads; keys on other seq devices come round the ring
        return (sequence.attention_ring(q, k, v) if ring else sequence.attention_local(q, k, v))[0]

    def loss_local(p, x, y):  # this device's share of the global mean
        def block(h, b):
            h = h + tensor.attention_tp(norm(h, b["ln1"]), b["attn"], tp, core)
            return h + tensor.mlp_tp(norm(h, b["ln2"]), b["mlp"], tp, jax.nn.gelu), None

        h, _ = jax.lax.scan(block, x @ p["embed"]["kernel"] + p["embed"]["bias"], p["blocks"])
        err = h @ p["readout"]["kernel"] + p["readout"]["bias"] - y
        return jnp.sum(err**2) / (y.size * mesh.shape["data"] * mesh.shape["seq"])

    tokens = P("data", "seq")  # batch over data, tokens over seq
    return ShardedModel(mesh, param_axes(DIMS["layers"]), RULES, loss_local,
                        batch_specs=(tokens, tokens), token_axes=("seq",))  # fmt: skip


# --8<-- [end:sharded]


# --8<-- [start:contract]
def expected_collectives(mesh, batch, tokens, dim, heads, layers, local_params):
    """What one train step must send, per device, from DESIGN.md's formulas (fp32)."""
    n_data, n_seq, n_model = (mesh.shape[a] for a in ("data", "seq", "model"))
    acts = batch // n_data * tokens // n_seq * dim * 4  # one activation block [b, t, d]
    kv = acts // n_model  # one K or V block [b, t, h/n, k]
    out = []
    if n_model > 1:  # two Megatron regions per block: g forward, f backward
        out.append(contract.all_reduce("model", acts, n_model, 4 * layers, "Megatron f, g"))
    if n_seq > 1:  # ring: K, V go round (n−1 hops) forward and again backward; dK, dV n hops
        hops = 2 * layers * (n_seq - 1) * 2 + 2 * layers * n_seq
        out.append(contract.permute("seq", kv, hops, "K, V, dK, dV round the ring"))
    sync = tuple(a for a in ("data", "seq") if mesh.shape[a] > 1)
    if sync:  # every gradient and the loss: one combined all-reduce at the step's end
        size = (local_params + 1) * 4
        out.append(contract.all_reduce(sync, size, n_data * n_seq, 1, "gradients + loss"))
    return out


# --8<-- [end:contract]


def batch_of(seed, batch, tokens, d_in):
    """x random; y: every token's target is the mean of its sequence (attention needed)."""
    x = jax.random.normal(jax.random.key(seed), (batch, tokens, d_in))
    return x, jnp.broadcast_to(x.mean(1, keepdims=True), x.shape)


def local_param_count(model, params):
    return sum(a.addressable_shards[0].data.size for a in jax.tree.leaves(model.shard(params)))


# --8<-- [start:main]
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=2,seq=2,model=2")
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    mesh = shardkit.make_mesh(shardkit.parse_mesh(args.mesh))
    model, d = sharded_model(mesh), DIMS
    params = init(0, d["d_in"], d["dim"], d["heads"], d["mlp"], d["layers"])
    x, y = batch_of(1, d["batch"], d["tokens"], d["d_in"])

    check = testing.compare_sharded(model.loss_and_grads, twin_loss, params, x, y,
                                    place=model.shard)  # fmt: skip
    check.assert_ok()
    print(f"sharded == twin: worst {check.worst[0]} at {check.worst[1]:.1e}")

    optimizer = optax.adamw(optax.cosine_decay_schedule(3e-3, args.steps), weight_decay=1e-4)
    step = model.train_step(optimizer, clip_norm=1.0)
    p = model.shard(params)
    state = model.init_opt_state(optimizer, p)
    want = expected_collectives(mesh, d["batch"], d["tokens"], d["dim"], d["heads"], d["layers"],
                                local_param_count(model, params))  # fmt: skip
    # The clipped step adds the global gradient norm: one scalar all-reduce over every axis.
    if model.reduce_axes:
        want.append(contract.all_reduce(model.reduce_axes, 4, mesh.size, 1, "gradient norm"))
    ledger = contract.assert_contract(step, p, state, *model.shard_batch(x, y), expected=want)
    print(f"contract holds: {ledger.total_bytes_sent():,.0f} bytes sent per device per step")
    for i in range(args.steps):
        xb, yb = model.shard_batch(*batch_of(100 + i, d["batch"], d["tokens"], d["d_in"]))
        p, state, metrics = step(p, state, xb, yb)
        jax.block_until_ready(metrics)  # one step in flight: see the module docstring
        if i in (0, args.steps - 1):
            print(f"step {i + 1:4d}  loss {float(metrics['loss']):.4f}")
    print(f"(predicting 0 everywhere: loss {float(jnp.mean(y**2)):.4f})")


# --8<-- [end:main]


if __name__ == "__main__":
    main()
