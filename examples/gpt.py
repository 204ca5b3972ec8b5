"""A causal character-level decoder, Llama style, built only from shardkit primitives, on
data × expert × seq × model: ``shardkit.models.gpt``, verified, trained and sampled from.

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
``--experts``, the five expert-parallel plans of docs/strategies/moe.md). The command line
runs the same model: ``shardkit verify | inspect | train --model gpt`` (or ``moe-gpt``).

The training loop waits for each step before the next: on XLA:CPU several in-flight
executions of one 8-device program can deadlock its in-process collectives (seen in CI: 4 of
8 device threads waiting forever at a collective-permute, the others queued behind them).
"""

import argparse
import dataclasses

import shardkit

shardkit.set_cpu_devices(8)  # before any other JAX call

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from shardkit import moe, testing  # noqa: E402
from shardkit.models import gpt  # noqa: E402
from shardkit.parallel.sequence import layouts  # noqa: E402
from shardkit.run import lm  # noqa: E402


# --8<-- [start:verify]
def verify(cfg, plan, params, x, y):
    """compare_sharded on one plan: the batch in the plan's layout for the sharded side; with
    experts the twin routes in the sharded run's groups (and the step's loss is a dict)."""
    model = gpt.sharded_gpt(shardkit.make_mesh(plan.mesh), cfg, plan)
    order = lambda a: layouts.to_layout(a, plan.mesh["seq"], plan.layout)  # noqa: E731

    def sharded(p, x, y):
        loss, grads = model.loss_and_grads(p, order(x), order(y))
        return (loss["loss"] if cfg.experts else loss), grads

    twin = lambda p, x, y: gpt.twin_loss(p, x, y, cfg, plan)  # noqa: E731
    return testing.compare_sharded(sharded, twin, params, x, y, place=model.shard)


# --8<-- [end:verify]


def sample(p, cfg, prompt, length):
    """Greedy continuation of ``prompt`` with the (unsharded) twin; experts route dropless."""
    if cfg.experts is not None:
        cfg = dataclasses.replace(
            cfg, experts=dataclasses.replace(cfg.experts, capacity_factor=None)
        )
    ids = [gpt.CHARS.index(c) for c in prompt]
    step = jax.jit(lambda p, x: gpt.twin_logits(p, x, cfg)[0][0, -1].argmax())
    for _ in range(length):
        window = ids[-cfg.tokens :]
        ids.append(int(step(p, jnp.asarray([window], jnp.int32))))
    return "".join(gpt.CHARS[i] if i < len(gpt.CHARS) else "?" for i in ids)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=2,seq=2,model=2")
    parser.add_argument("--layout", default="zigzag", choices=layouts.LAYOUTS)
    parser.add_argument("--core", default="ring", choices=gpt.model.CORES)
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
    args.cfg = gpt.GPTConfig()
    if args.experts:
        factor = None if args.capacity_factor == "none" else float(args.capacity_factor)
        try:
            args.cfg = gpt.moe_config(moe.MoE(args.experts, args.top_k, factor))
        except ValueError as err:
            parser.error(str(err))
    return args


def report(i, metrics, cfg):
    line = f"step {i + 1:4d}  loss {float(metrics['loss']):.4f}"
    if cfg.experts:
        line += f"  dropped {float(metrics['dropped_fraction']):6.1%}"
    print(line)


def main() -> None:
    args = parse_args()
    cfg = args.cfg
    params = gpt.init(0, cfg)
    rng = np.random.default_rng(0)
    x, y = gpt.windows(rng, args.batch, cfg.tokens)
    if args.verify_plans:
        for name, plan in lm.default_plans(cfg).items():
            check = verify(cfg, plan, params, x, y)
            check.assert_ok()
            mesh = ",".join(f"{a}={n}" for a, n in plan.mesh.items() if n > 1)
            print(f"{name:22s} {mesh:22s} worst {check.worst[0]} at {check.worst[1]:.1e}")
        return
    plan = gpt.GPTPlan(shardkit.parse_mesh(args.mesh), args.layout, args.core, args.fsdp)
    gpt.check_plan(cfg, plan, args.batch)
    check = verify(cfg, plan, params, x, y)
    check.assert_ok()
    print(f"sharded == twin: worst {check.worst[0]} at {check.worst[1]:.1e}")

    model = gpt.sharded_gpt(shardkit.make_mesh(plan.mesh), cfg, plan)
    order = lambda *xs: tuple(layouts.to_layout(a, plan.mesh["seq"], plan.layout) for a in xs)  # noqa: E731
    warmup = min(20, args.steps // 2)
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0, 1e-2, warmup, args.steps))
    step = model.train_step(optimizer, clip_norm=1.0)
    p = model.shard(params)
    state = model.init_opt_state(optimizer, p)
    for i in range(args.steps):
        batch = model.shard_batch(*order(*gpt.windows(rng, args.batch, cfg.tokens)))
        p, state, metrics = step(p, state, *batch)
        jax.block_until_ready(metrics)  # one step in flight: see the module docstring
        if not np.isfinite(float(metrics["loss"])):
            raise SystemExit(f"step {i + 1}: the loss is {float(metrics['loss'])}; stopping.")
        if i == 0 or (i + 1) % 100 == 0 or i + 1 == args.steps:
            report(i, metrics, cfg)
    if cfg.experts:
        counts = np.asarray(metrics["tokens_per_expert"], int).tolist()
        print(f"tokens per expert (last step, all layers): {counts}")
    print(f"(uniform over {len(gpt.CHARS)} characters: loss {np.log(len(gpt.CHARS)):.4f})")
    print("sample:", repr(sample(jax.device_get(p), cfg, "Beautiful is", 80)))


if __name__ == "__main__":
    main()
