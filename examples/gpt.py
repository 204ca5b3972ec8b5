"""A causal character-level decoder, Llama style, built only from shardkit primitives, on
data × seq × model.

RMSNorm, rotary embeddings at each token's global position (``lm.rope`` and
``layouts.local_positions``), grouped-query attention (``tensor.attention_tp`` around
``sequence.attention_ring``, causal, zigzag layout over ``seq``; or ``attention_ulysses``, any
layout; KV weights whole and ``kv_repeat`` when ``model`` outnumbers the KV heads), a SwiGLU
MLP (``tensor.gated_mlp_tp``), no biases, and the vocabulary split over ``model`` in the
embedding and the untied head (``lm.vocab_embed``, ``lm.vocab_cross_entropy``: the logits are
never gathered), on ``shardkit.ShardedModel``. ``--experts E`` makes it a mixture of experts:
each block's MLP becomes E SwiGLU experts behind a top-k router (``moe.moe_layer``), split over
an ``expert`` mesh axis that also splits the batch (``--mesh data=2,expert=4``), the load-
balance and router z-losses added to the loss, tokens per expert and drops reported per step.
Verified against its unsharded twin (``testing.compare_sharded``: loss, every gradient leaf,
one AdamW step), then trained on the Zen of Python (it ships with Python: ``this.s``), and
sampled from:

    python examples/gpt.py [--mesh data=2,seq=2,model=2] [--layout zigzag] [--core ring]
                           [--fsdp] [--steps 300] [--verify-plans]
                           [--experts 8 --top-k 2 --capacity-factor 1.25]

``--verify-plans`` checks the five plans of docs/llama.md instead of training (with
``--experts``, the five expert-parallel plans of docs/strategies/moe.md).

The training loop waits for each step before the next: on XLA:CPU several in-flight
executions of one 8-device program can deadlock its in-process collectives (seen in CI: 4 of
8 device threads waiting forever at a collective-permute, the others queued behind them).
"""

import argparse
import codecs
import contextlib
import dataclasses
import io

import shardkit

shardkit.set_cpu_devices(8)  # before any other JAX call

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe_ref  # noqa: E402
from shardkit import ShardedModel, lm, moe, sequence, tensor, testing, vma  # noqa: E402
from shardkit.parallel.sequence import layouts  # noqa: E402

with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
    import this
TEXT = codecs.decode(this.s, "rot13")
CHARS = sorted(set(TEXT))
VOCAB = -(-len(CHARS) // 8) * 8  # padded so it splits over up to 8 model devices
DIMS = {"dim": 64, "heads": 8, "kv_heads": 2, "mlp": 128, "layers": 2, "tokens": 64}
MOE_DIMS = {**DIMS, "mlp": 64}  # each expert's hidden dim
ALPHA, BETA = 1e-2, 1e-3  # the load-balance and router z-loss weights


# --8<-- [start:axes]
def param_axes(experts=False):
    w = lambda *names: {"kernel": names}  # noqa: E731  (no biases)
    mlp = {"gate": w("embed", "mlp"), "up": w("embed", "mlp"), "down": w("mlp", "embed")}
    if experts:  # E experts' SwiGLUs, stacked, and the router (replicated)
        mlp = {
            "router": ("embed", "router"),
            "gate": ("expert", "embed", "mlp"),
            "up": ("expert", "embed", "mlp"),
            "down": ("expert", "mlp", "embed"),
        }
    block = {"norm1": ("embed",), "norm2": ("embed",), "mlp": mlp,
             "attn": {"query": w("embed", "heads", "head_dim"),
                      "key": w("embed", "kv_heads", "head_dim"),
                      "value": w("embed", "kv_heads", "head_dim"),
                      "out": w("heads", "head_dim", "embed")}}  # fmt: skip
    stacked = jax.tree.map(lambda n: ("layers", *n), block, is_leaf=lambda x: isinstance(x, tuple))
    return {"embed": ("vocab", "embed"), "head": ("embed", "vocab"), "blocks": stacked,
            "norm": ("embed",)}  # fmt: skip


def rules(n_model, kv_heads, fsdp):
    """Heads, MLP and vocabulary over model; KV heads too unless model outnumbers them
    (then they stay whole and ``kv_repeat`` picks each device's one); experts over expert;
    ``fsdp``: embed over data."""
    out = {"heads": "model", "mlp": "model", "vocab": "model", "expert": "expert"}
    if n_model <= kv_heads:
        out["kv_heads"] = "model"
    return {**out, "embed": "data"} if fsdp else out


# --8<-- [end:axes]


def init(seed, d, experts=0):
    sizes = {"vocab": VOCAB, "embed": d["dim"], "heads": d["heads"], "mlp": d["mlp"],
             "kv_heads": d["kv_heads"], "head_dim": d["dim"] // d["heads"],
             "layers": d["layers"], "expert": experts, "router": experts}  # fmt: skip
    names, tree = jax.tree.flatten(param_axes(experts > 0), is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(seed), len(names))

    def leaf(key, ns):
        dims = [n for n in ns if n not in ("layers", "expert")]  # the first is the fan-in
        noise = jax.random.normal(key, [sizes[n] for n in ns])
        return noise / np.sqrt(sizes[dims[0]]) if len(dims) > 1 else 1.0 + 0.1 * noise

    return jax.tree.unflatten(tree, [leaf(k, ns) for k, ns in zip(keys, names, strict=True)])


# --8<-- [start:twin]
def twin_logits(p, x, routing=None):
    """The unsharded decoder in plain jnp: x[B, T] token ids -> (logits[B, T, V], aux losses
    summed over layers). ``routing``: (MoE, groups, seq devices, layout) for the MoE blocks:
    the tokens are routed in the sharded run's groups (its layout's order over seq)."""
    pos = jnp.arange(x.shape[1])

    def experts(z, m):  # moe_ref routes the groups the sharded run's devices hold
        cfg, grouping, n_seq, layout = routing
        z = layouts.to_layout(z, n_seq, layout)
        out, aux = moe_ref.layer(m, z, cfg, grouping)
        return layouts.from_layout(out, n_seq, layout), ALPHA * aux["load_balance"] + BETA * aux[
            "router_z"
        ]

    def attention(h, a):
        q, k, v = (
            jnp.einsum("btd,dhk->bthk", h, a[n]["kernel"]) for n in ("query", "key", "value")
        )
        q, k = lm.apply_rope(q, pos), lm.apply_rope(k, pos)
        k, v = (jnp.repeat(z, q.shape[2] // z.shape[2], axis=2) for z in (k, v))  # GQA
        s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones((x.shape[1],) * 2, bool)), s, -jnp.inf)
        w = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bhts,bshk,hkd->btd", w, v, a["out"]["kernel"])

    def block(h, b):
        h = h + attention(lm.rms_norm(h, b["norm1"]), b["attn"])
        z, m = lm.rms_norm(h, b["norm2"]), b["mlp"]
        if routing is not None:
            z, aux = experts(z, m)
            return h + z, aux
        z = jax.nn.silu(z @ m["gate"]["kernel"]) * (z @ m["up"]["kernel"])
        return h + z @ m["down"]["kernel"], jnp.zeros(())

    h, aux = jax.lax.scan(block, p["embed"][x], p["blocks"])
    return lm.rms_norm(h, p["norm"]) @ p["head"], aux.sum()


def twin_loss(p, x, y, routing=None):
    logits, aux = twin_logits(p, x, routing)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() + aux


# --8<-- [end:twin]


# --8<-- [start:sharded]
def sharded_gpt(mesh, layout, core="ring", fsdp=False, dims=DIMS, experts=None):
    """x, y[B_data×expert, T_seq] in ``layout`` order over seq; heads, MLP, vocabulary over
    model; ``fsdp``: every embed dim over data too (``ShardedModel`` gathers before the loss);
    ``experts`` (a ``moe.MoE``): MoE blocks, experts over expert, each expert's MLP over model,
    and the step reports tokens per expert, drops and the load-balance loss."""
    n_model, n_seq = mesh.shape["model"], mesh.shape["seq"]
    tp, sp = ("model" if n_model > 1 else None), ("seq" if n_seq > 1 else None)
    ep = "expert" if mesh.shape["expert"] > 1 else None
    kv_repeat = n_model > dims["kv_heads"]
    attend = {"ring": sequence.attention_ring, "ulysses": sequence.attention_ulysses}[core]
    groups = {"batch_axes": ("data", "expert"), "seq_axes": ("seq",)}  # the tokens' spec

    def causal_core(q, k, v):  # over seq on local heads; GQA K/V blocks stay h_kv-headed
        return attend(q, k, v, causal=True, layout=layout)[0]

    def mlp(z, m):  # SwiGLU over model, or the experts: (out, aux losses' share, counts)
        if experts is None:
            return tensor.gated_mlp_tp(z, m, tp), jnp.zeros(()), jnp.zeros(1)
        out, aux = moe.moe_layer(z, m, experts, expert_axis=ep, tp=tp, **groups)
        counts = jnp.concatenate([aux.tokens_per_expert, aux.dropped[None]])
        return out, ALPHA * aux.load_balance + BETA * aux.router_z, counts

    def loss_local(p, x, y):  # this device's share of the loss, and the step's MoE metrics
        rope = lm.rope(layouts.local_positions(layout, sp, x.shape[1]))  # GLOBAL positions

        @vma.checked_block  # a forgotten row-parallel reduction is named here, at trace time
        def block(h, b):
            a = tensor.attention_tp(lm.rms_norm(h, b["norm1"]), b["attn"], tp, causal_core,
                                    rope=rope, kv_repeat=kv_repeat)  # fmt: skip
            h = h + a
            z, aux, counts = mlp(lm.rms_norm(h, b["norm2"]), b["mlp"])
            return h + z, (aux, counts)

        h, (aux, counts) = jax.lax.scan(block, lm.vocab_embed(x, p["embed"], tp), p["blocks"])
        logits = lm.vocab_logits(lm.rms_norm(h, p["norm"]), p["head"], tp)  # [b, t, V/n]
        ce = lm.vocab_cross_entropy(logits, y, tp)
        share = ce.sum() / (y.size * mesh.shape["data"] * mesh.shape["expert"] * n_seq)
        if experts is None:
            return share
        return share + aux.sum(), moe_metrics(counts, y.size * mesh.size // n_model)

    def moe_metrics(counts, tokens):  # counts [layers, E + 1]: global, the same everywhere
        per_expert, dropped = counts[:, :-1].sum(0), counts[:, -1].sum()
        routed = tokens * experts.top_k * dims["layers"]
        return {"tokens_per_expert": per_expert, "dropped": dropped,
                "dropped_fraction": dropped / routed}  # fmt: skip

    tokens = P(("data", "expert"), "seq")
    return ShardedModel(mesh, param_axes(experts is not None),
                        rules(n_model, dims["kv_heads"], fsdp), loss_local,
                        batch_specs=(tokens, tokens), token_axes=("expert", "seq"),
                        aux=experts is not None)  # fmt: skip


# --8<-- [end:sharded]

# --8<-- [start:plans]
PLANS = {  # name: (mesh, layout, core, fsdp)
    "data×model": ("data=2,model=4", "contiguous", "ring", False),
    "ring, zigzag": ("data=2,seq=4", "zigzag", "ring", False),
    "Ulysses, KV repeat": ("seq=2,model=4", "striped", "ulysses", False),
    "FSDP": ("data=4,model=2", "contiguous", "ring", True),
    "3-D: data×seq×model": ("data=2,seq=2,model=2", "zigzag", "ring", False),
}
MOE_PLANS = {  # the same, with --experts: experts over expert, which splits the batch too
    "EP=8": ("expert=8", "contiguous", "ring", False),
    "EP×DP": ("data=2,expert=4", "contiguous", "ring", False),
    "EP×TP×DP": ("data=2,expert=2,model=2", "contiguous", "ring", False),
    "EP×FSDP": ("data=2,expert=4", "contiguous", "ring", True),
    "EP×ring, zigzag": ("expert=2,seq=4", "zigzag", "ring", False),
}


def verify(mesh_flag, layout, core, fsdp, params, x, y, experts=None):
    """compare_sharded on one plan: the batch in ``layout`` order for the sharded side; with
    ``experts`` the twin routes in the sharded run's groups (and the step's loss is a dict)."""
    mesh = shardkit.make_mesh(shardkit.parse_mesh(mesh_flag))
    n_seq = mesh.shape["seq"]
    model = sharded_gpt(mesh, layout, core, fsdp, experts=experts, dims=dims_of(experts))
    order = lambda a: layouts.to_layout(a, n_seq, layout)  # noqa: E731

    def sharded(p, x, y):
        loss, grads = model.loss_and_grads(p, order(x), order(y))
        return (loss["loss"] if experts else loss), grads

    routing = experts and (experts, (mesh.shape["data"] * mesh.shape["expert"], n_seq), n_seq,
                           layout)  # fmt: skip
    return testing.compare_sharded(sharded, lambda p, x, y: twin_loss(p, x, y, routing or None),
                                   params, x, y, place=model.shard)  # fmt: skip


# --8<-- [end:plans]


def dims_of(experts):
    return DIMS if experts is None else MOE_DIMS


def windows(rng, batch, t):
    """x[B, T] random windows of the text, y the next characters."""
    ids = np.array([CHARS.index(c) for c in TEXT], np.int32)
    starts = rng.integers(0, len(ids) - t - 1, batch)
    x = np.stack([ids[s : s + t] for s in starts])
    return jnp.asarray(x), jnp.asarray(np.stack([ids[s + 1 : s + t + 1] for s in starts]))


def sample(p, prompt, length, experts=None):
    """Greedy continuation of ``prompt`` with the (unsharded) twin; experts route dropless."""
    routing = experts and (dataclasses.replace(experts, capacity_factor=None), (1, 1), 1,
                           "contiguous")  # fmt: skip
    ids = [CHARS.index(c) for c in prompt]
    step = jax.jit(lambda p, x: twin_logits(p, x, routing or None)[0][0, -1].argmax())
    for _ in range(length):
        window = ids[-DIMS["tokens"] :]
        ids.append(int(step(p, jnp.asarray([window], jnp.int32))))
    return "".join(CHARS[i] if i < len(CHARS) else "?" for i in ids)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=2,seq=2,model=2")
    parser.add_argument("--layout", default="zigzag", choices=layouts.LAYOUTS)
    parser.add_argument("--core", default="ring", choices=("ring", "ulysses"))
    parser.add_argument("--fsdp", action="store_true", help="split every embed dim over data")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--verify-plans", action="store_true", help="verify docs/llama.md's plans")
    parser.add_argument("--experts", type=int, default=0, help="E experts per block (0: dense)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", default="1.25", help="a number, or none (dropless)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2, got {args.steps}")
    args.moe = None
    if args.experts:
        factor = None if args.capacity_factor == "none" else float(args.capacity_factor)
        try:
            args.moe = moe.MoE(args.experts, args.top_k, factor)
        except ValueError as err:
            parser.error(str(err))
    return args


def report(i, metrics, experts):
    line = f"step {i + 1:4d}  loss {float(metrics['loss']):.4f}"
    if experts:
        line += f"  dropped {float(metrics['dropped_fraction']):6.1%}"
    print(line)


def main() -> None:
    args = parse_args()
    dims = dims_of(args.moe)
    params = init(0, dims, args.experts)
    rng = np.random.default_rng(0)
    x, y = windows(rng, args.batch, dims["tokens"])
    if args.verify_plans:
        for name, plan in (MOE_PLANS if args.moe else PLANS).items():
            check = verify(*plan, params, x, y, experts=args.moe)
            check.assert_ok()
            print(f"{name:22s} {plan[0]:22s} worst {check.worst[0]} at {check.worst[1]:.1e}")
        return
    check = verify(args.mesh, args.layout, args.core, args.fsdp, params, x, y, args.moe)
    check.assert_ok()
    print(f"sharded == twin: worst {check.worst[0]} at {check.worst[1]:.1e}")

    mesh = shardkit.make_mesh(shardkit.parse_mesh(args.mesh))
    model = sharded_gpt(mesh, args.layout, args.core, args.fsdp, dims, args.moe)
    order = lambda *xs: tuple(layouts.to_layout(a, mesh.shape["seq"], args.layout) for a in xs)  # noqa: E731
    warmup = min(20, args.steps // 2)
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0, 1e-2, warmup, args.steps))
    step = model.train_step(optimizer, clip_norm=1.0)
    p = model.shard(params)
    state = model.init_opt_state(optimizer, p)
    for i in range(args.steps):
        batch = model.shard_batch(*order(*windows(rng, args.batch, dims["tokens"])))
        p, state, metrics = step(p, state, *batch)
        jax.block_until_ready(metrics)  # one step in flight: see the module docstring
        if not np.isfinite(float(metrics["loss"])):
            raise SystemExit(f"step {i + 1}: the loss is {float(metrics['loss'])}; stopping.")
        if i == 0 or (i + 1) % 100 == 0 or i + 1 == args.steps:
            report(i, metrics, args.moe)
    if args.moe:
        counts = np.asarray(metrics["tokens_per_expert"], int).tolist()
        print(f"tokens per expert (last step, all layers): {counts}")
    print(f"(uniform over {len(CHARS)} characters: loss {np.log(len(CHARS)):.4f})")
    print("sample:", repr(sample(jax.device_get(p), "Beautiful is", 80, args.moe)))


if __name__ == "__main__":
    main()
