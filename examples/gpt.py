"""A causal character-level GPT built only from shardkit primitives, on data × seq × model.

Token embedding tied to the output head, learned positions, pre-LN causal blocks with
grouped-query attention (``tensor.attention_tp`` around ``sequence.attention_ring``, causal,
zigzag layout over ``seq``; or ``attention_ulysses``, any layout) and a GELU MLP
(``tensor.mlp_tp``), on ``shardkit.ShardedModel``. Verified against its unsharded twin
(``testing.compare_sharded``: loss, every gradient leaf, one AdamW step), then trained on the
Zen of Python (it ships with Python: ``this.s``), and sampled from:

    python examples/gpt.py [--mesh data=2,seq=2,model=2] [--layout zigzag] [--core ring]
                           [--fsdp] [--steps 300]
"""

import argparse
import codecs
import contextlib
import io

import shardkit

shardkit.set_cpu_devices(8)  # before any other JAX call

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardkit import ShardedModel, sequence, tensor, testing  # noqa: E402
from shardkit.parallel.sequence import layouts  # noqa: E402

with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
    import this
TEXT = codecs.decode(this.s, "rot13")
VOCAB = sorted(set(TEXT))
DIMS = {"dim": 64, "heads": 4, "kv_heads": 2, "mlp": 128, "layers": 2, "tokens": 64}


def param_axes(layers):
    dense = lambda i, o: {"kernel": (i, o), "bias": (o,)}  # noqa: E731
    proj = lambda h: {"kernel": ("embed", h, "head_dim"), "bias": (h, "head_dim")}  # noqa: E731
    block = {"ln1": ("embed",), "ln2": ("embed",),
             "attn": {"query": proj("heads"), "key": proj("kv_heads"), "value": proj("kv_heads"),
                      "out": {"kernel": ("heads", "head_dim", "embed"), "bias": ("embed",)}},
             "mlp": {"fc1": dense("embed", "mlp"), "fc2": dense("mlp", "embed")}}  # fmt: skip
    stacked = jax.tree.map(lambda n: ("layers", *n), block, is_leaf=lambda x: isinstance(x, tuple))
    return {"embed": ("vocab", "embed"), "pos": ("tokens", "embed"), "blocks": stacked,
            "ln_f": ("embed",)}  # fmt: skip


RULES = {"heads": "model", "kv_heads": "model", "mlp": "model"}


def init(seed, d):
    sizes = {"vocab": len(VOCAB), "embed": d["dim"], "heads": d["heads"], "mlp": d["mlp"],
             "kv_heads": d["kv_heads"], "head_dim": d["dim"] // d["heads"],
             "layers": d["layers"], "tokens": d["tokens"]}  # fmt: skip
    names, tree = jax.tree.flatten(param_axes(d["layers"]), is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(seed), len(names))

    def leaf(key, ns):
        dims = [n for n in ns if n != "layers"]
        noise = jax.random.normal(key, [sizes[n] for n in ns])
        return noise / np.sqrt(sizes[dims[0]]) if len(dims) > 1 else 0.1 * noise

    p = jax.tree.unflatten(tree, [leaf(k, ns) for k, ns in zip(keys, names, strict=True)])
    for name in ("ln1", "ln2"):
        p["blocks"][name] = p["blocks"][name] + 1.0
    p["ln_f"] = p["ln_f"] + 1.0
    return p


def norm(x, scale):
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale


def logits_of(p, h):
    return norm(h, p["ln_f"]) @ p["embed"].T  # head tied to the token embedding


# --8<-- [start:twin]
def twin_logits(p, x):
    """The unsharded GPT in plain jnp: x[B, T] token ids -> logits[B, T, V]."""

    def attention(h, a):
        q, k, v = (jnp.einsum("btd,dhk->bthk", h, a[n]["kernel"]) + a[n]["bias"]
                   for n in ("query", "key", "value"))  # fmt: skip
        k, v = (jnp.repeat(z, q.shape[2] // z.shape[2], axis=2) for z in (k, v))  # GQA
        s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones((x.shape[1],) * 2, bool)), s, -jnp.inf)
        w = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bhts,bshk,hkd->btd", w, v, a["out"]["kernel"]) + a["out"]["bias"]

    def block(h, b):
        h = h + attention(norm(h, b["ln1"]), b["attn"])
        z = jax.nn.gelu(norm(h, b["ln2"]) @ b["mlp"]["fc1"]["kernel"] + b["mlp"]["fc1"]["bias"])
        return h + z @ b["mlp"]["fc2"]["kernel"] + b["mlp"]["fc2"]["bias"], None

    h, _ = jax.lax.scan(block, p["embed"][x] + p["pos"][: x.shape[1]], p["blocks"])
    return logits_of(p, h)


def twin_loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(twin_logits(p, x), y).mean()


# --8<-- [end:twin]


# --8<-- [start:sharded]
def sharded_gpt(mesh, layout, core="ring", fsdp=False):
    """x, y[B_data, T_seq] in ``layout`` order over seq; heads, KV heads, MLP over model;
    ``fsdp``: every embed dim over data too (``ShardedModel`` gathers before the loss)."""
    tp = "model" if mesh.shape["model"] > 1 else None
    n_seq = mesh.shape["seq"]
    attend = {"ring": sequence.attention_ring, "ulysses": sequence.attention_ulysses}[core]

    def causal_core(q, k, v):  # over seq on local heads; GQA K/V blocks stay h_kv-headed
        return attend(q, k, v, causal=True, layout=layout)[0]

    def loss_local(p, x, y):  # this device's share of the mean next-token cross-entropy
        table = jnp.asarray(layouts.positions(layout, n_seq, x.shape[1]))
        positions = table[jax.lax.axis_index("seq")] if n_seq > 1 else table[0]

        def block(h, b):
            h = h + tensor.attention_tp(norm(h, b["ln1"]), b["attn"], tp, causal_core)
            return h + tensor.mlp_tp(norm(h, b["ln2"]), b["mlp"], tp, jax.nn.gelu), None

        h, _ = jax.lax.scan(block, p["embed"][x] + p["pos"][positions], p["blocks"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits_of(p, h), y)
        return ce.sum() / (y.size * mesh.shape["data"] * n_seq)

    tokens, rules = P("data", "seq"), {**RULES, "embed": "data"} if fsdp else RULES
    return ShardedModel(mesh, param_axes(DIMS["layers"]), rules, loss_local,
                        batch_specs=(tokens, tokens), token_axes=("seq",))  # fmt: skip


# --8<-- [end:sharded]


def windows(rng, batch, t):
    """x[B, T] random windows of the text, y the next characters."""
    ids = np.array([VOCAB.index(c) for c in TEXT], np.int32)
    starts = rng.integers(0, len(ids) - t - 1, batch)
    x = np.stack([ids[s : s + t] for s in starts])
    return jnp.asarray(x), jnp.asarray(np.stack([ids[s + 1 : s + t + 1] for s in starts]))


def sample(p, prompt, length):
    """Greedy continuation of ``prompt`` with the (unsharded) twin."""
    ids = [VOCAB.index(c) for c in prompt]
    step = jax.jit(lambda p, x: twin_logits(p, x)[0, -1].argmax())
    for _ in range(length):
        window = ids[-DIMS["tokens"] :]
        ids.append(int(step(p, jnp.asarray([window], jnp.int32))))
    return "".join(VOCAB[i] for i in ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=2,seq=2,model=2")
    parser.add_argument("--layout", default="zigzag", choices=layouts.LAYOUTS)
    parser.add_argument("--core", default="ring", choices=("ring", "ulysses"))
    parser.add_argument("--fsdp", action="store_true", help="split every embed dim over data")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2, got {args.steps}")
    mesh = shardkit.make_mesh(shardkit.parse_mesh(args.mesh))
    model = sharded_gpt(mesh, args.layout, args.core, args.fsdp)
    n_seq = mesh.shape["seq"]
    order = lambda *xs: tuple(layouts.to_layout(x, n_seq, args.layout) for x in xs)  # noqa: E731
    params = init(0, DIMS)
    rng = np.random.default_rng(0)
    x, y = windows(rng, args.batch, DIMS["tokens"])

    check = testing.compare_sharded(lambda p, x, y: model.loss_and_grads(p, *order(x, y)),
                                    twin_loss, params, x, y, place=model.shard)  # fmt: skip
    check.assert_ok()
    print(f"sharded == twin: worst {check.worst[0]} at {check.worst[1]:.1e}")

    warmup = min(20, args.steps // 2)
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0, 1e-2, warmup, args.steps))
    step = model.train_step(optimizer, clip_norm=1.0)
    p = model.shard(params)
    state = model.init_opt_state(optimizer, p)
    for i in range(args.steps):
        batch = model.shard_batch(*order(*windows(rng, args.batch, DIMS["tokens"])))
        p, state, metrics = step(p, state, *batch)
        if i == 0 or (i + 1) % 100 == 0 or i + 1 == args.steps:
            print(f"step {i + 1:4d}  loss {float(metrics['loss']):.4f}")
    print(f"(uniform over {len(VOCAB)} characters: loss {np.log(len(VOCAB)):.4f})")
    print("sample:", repr(sample(jax.device_get(p), "Beautiful is", 80)))


if __name__ == "__main__":
    main()
