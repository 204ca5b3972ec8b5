"""Train the sharded ViT for a few steps, side by side with the unsharded reference.

Both start from the same ``vit_ref.init`` params (one pytree serves both) and take the same
AdamW steps on the same synthetic batch; the losses are printed per step and must agree to
1e-5 relative. The plan comes from flags, as in the ``shardkit`` command:

    python examples/train_vit_sharded.py --mesh data=2,seq=2,model=2 --sp ring --fsdp
    python examples/train_vit_sharded.py --mesh data=4,model=2                 # DP × TP
    python examples/train_vit_sharded.py --mesh data=2,seq=4 --sp usp --ulysses 2
    python examples/train_vit_sharded.py --mesh data=2,model=4 --sp megatron --remat

The model is vit_ref's "mu" variant (32px images, patch 8, width 32) with 4 heads and a class
token: 16 patches + 1 = 17 tokens, a prime, so every token-splitting mode pads and masks.
A plan that cannot work (say ``--mesh model=8``: 4 heads) prints one sentence and exits 2.
"""

import argparse
import sys

import shardkit

shardkit.set_cpu_devices(8)  # before any other JAX call: the backend fixes its device count once

import jax  # noqa: E402
import numpy as np  # noqa: E402

import vit_ref  # noqa: E402

TOL = 1e-5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=2,seq=2,model=2", help="omitted axes are 1")
    parser.add_argument("--sp", default="ring", choices=shardkit.SP_MODES)
    parser.add_argument("--ulysses", type=int, default=None, help="Ulysses degree for --sp usp")
    parser.add_argument("--fsdp", action="store_true", help="split params over data (ZeRO-3)")
    parser.add_argument("--remat", action="store_true", help="recompute blocks in backward")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4, help="mu has 2; 4 lets model=4 work")
    return parser.parse_args()


def synthetic_batch(cfg: vit_ref.ViTConfig, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Random images and random labels: the model can only memorise them, so loss falls."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(batch, cfg.image, cfg.image, cfg.channels)).astype(np.float32)
    return images, rng.integers(0, cfg.classes, size=batch).astype(np.int32)


def main() -> int:
    args = parse_args()
    # A random head (not big_vision's zero init) so the logits depend on the body from step 0.
    cfg = vit_ref.variant("mu", depth=args.depth, heads=args.heads, pool="tok", head_zeroinit=False)
    try:
        plan = shardkit.Plan(
            shardkit.parse_mesh(args.mesh), sp=args.sp, ulysses=args.ulysses,
            fsdp=args.fsdp, remat=args.remat,
        )  # fmt: skip
        model = shardkit.ShardedViT(cfg, plan)  # validates the plan against cfg
        model.check_batch(args.batch)
    except shardkit.PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{model}, {cfg.num_tokens} tokens, batch {args.batch}")

    optimizer = vit_ref.make_optimizer(learning_rate=1e-3)
    ref_params = vit_ref.init(jax.random.key(0), cfg)
    # shard() places a COPY on the mesh: both steps donate their params, neither aliases.
    params = model.shard(ref_params)
    opt_state = model.init_opt_state(optimizer, params)  # sharded like params
    ref_opt_state = optimizer.init(ref_params)
    ref_step, step = vit_ref.make_train_step(cfg, optimizer), model.train_step(optimizer)

    images, labels = synthetic_batch(cfg, args.batch)
    images_sharded, labels_sharded = model.shard_batch(images, labels)  # batch split over data

    worst = 0.0
    print(f"{'step':>4} {'reference loss':>15} {'sharded loss':>15} {'rel. diff':>10}")
    for i in range(args.steps):
        ref_params, ref_opt_state, ref_metrics = ref_step(ref_params, ref_opt_state, images, labels)
        params, opt_state, metrics = step(params, opt_state, images_sharded, labels_sharded)
        ref_loss, loss = float(ref_metrics["loss"]), float(metrics["loss"])
        diff = abs(loss - ref_loss) / abs(ref_loss)
        worst = max(worst, diff)
        print(f"{i:>4} {ref_loss:>15.7f} {loss:>15.7f} {diff:>10.1e}")

    agree = worst <= TOL
    print(
        f"losses {'agree' if agree else 'DIFFER'}: max relative difference {worst:.1e} "
        f"({'<=' if agree else '>'} {TOL:g})"
    )
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
