"""Train a sharded ViT on the bundled digits with the library API (no CLI): a loop to copy.

What ``shardkit train`` does, in the open: a plan, ``ShardedViT`` (it takes ``vit_ref.init``'s
params pytree as is), AdamW with warmup + cosine decay, gradients clipped to a global norm that
the step computes from the shards, a shuffled loader that places each batch on the mesh, and an
evaluation on the held-out split:

    python examples/train_vit.py                                         # data=2,seq=2,model=2 ring
    python examples/train_vit.py --mesh data=4,model=2 --sp none --steps 200
"""

import argparse
import sys

import shardkit

shardkit.set_cpu_devices(8)  # before any other JAX call

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import vit_ref  # noqa: E402
from shardkit.run import datasets  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=2,seq=2,model=2", help="omitted axes are 1")
    parser.add_argument("--sp", default="ring", choices=shardkit.SP_MODES)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args()


def evaluate(model: shardkit.ShardedViT, params, ds: datasets.Dataset, batch: int) -> float:
    """Test accuracy: whole batches on the mesh (the remainder is padded, then ignored)."""
    n = len(ds.test_labels)
    pad = -n % batch
    images = np.concatenate([ds.test_images, np.zeros((pad, *ds.test_images.shape[1:]))])
    correct = []
    for start in range(0, n + pad, batch):
        (x,) = model.shard_batch(images[start : start + batch].astype(np.float32))
        correct.append(np.asarray(model.forward(params, x)).argmax(-1))
    return float((np.concatenate(correct)[:n] == ds.test_labels).mean())


def main() -> int:
    args = parse_args()
    ds = datasets.load("digits")  # 8×8 grey digits, normalised; fixed train/test split
    cfg = vit_ref.ViTConfig(
        image=8, patch=2, channels=1, classes=10, dim=64, depth=2, heads=8, mlp_dim=128,
        pool="tok",
    )  # fmt: skip
    try:
        plan = shardkit.Plan(shardkit.parse_mesh(args.mesh), sp=args.sp, fsdp=args.fsdp)
        model = shardkit.ShardedViT(cfg, plan)  # checks the plan against the model
        model.check_batch(args.batch)
    except shardkit.PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{model}: {cfg.num_tokens} tokens, {len(ds.train_labels)} training images")

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.steps // 10, args.steps)
    optimizer = vit_ref.make_optimizer(schedule, weight_decay=1e-4)
    params = model.shard(vit_ref.init(jax.random.key(0), cfg))  # each leaf split per the plan
    opt_state = model.init_opt_state(optimizer, params)  # sharded like the params
    # Clipping needs the global norm: the step computes it from the shards (one scalar psum).
    step = model.train_step(optimizer, clip_norm=1.0)
    loader = datasets.Loader(ds.train_images, ds.train_labels, args.batch, seed=0)
    batches = loader.batches(0, args.steps, model.sharding(model.batch_spec))

    for i, (images, labels) in enumerate(batches, start=1):
        params, opt_state, metrics = step(params, opt_state, images, labels)
        if i % 50 == 0 or i == args.steps:
            loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
            accuracy = evaluate(model, params, ds, args.batch)
            print(f"step {i:>4}  epoch {loader.epoch(i - 1):>3}  loss {loss:.4f}  "
                  f"grad_norm {norm:.3f}  test_accuracy {accuracy:.4f}")  # fmt: skip
            if not np.isfinite(loss):
                print(f"error: the loss became {loss} at step {i}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
