"""Lists the collectives of the sharded ViT's compiled train step for each default strategy.

    python docs/measure/collectives_per_strategy.py [--case ring] [--detail]

Model: vit_ref "mu" (width 32, MLP 128) with 8 heads, depth 2, class token (17 tokens); batch 8;
8 CPU devices; AdamW. Counts are executions per step (a collective inside the layer scan counts
once per layer), from ``shardkit.ledger.measure`` on the compiled HLO.
"""

import argparse

import shardkit

shardkit.set_cpu_devices(8)

import jax  # noqa: E402

import vit_ref  # noqa: E402
from shardkit import ledger  # noqa: E402
from shardkit.run import verify  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", help="one case name of verify.default_matrix (default: all)")
    parser.add_argument("--detail", action="store_true", help="one line per HLO instruction")
    args = parser.parse_args()
    cfg = vit_ref.variant("mu", depth=2, heads=8, pool="tok", head_zeroinit=False)
    optimizer = vit_ref.make_optimizer()
    for case in verify.default_matrix(8):
        if args.case and case.name != args.case:
            continue
        model = shardkit.ShardedViT(cfg, case.plan)
        params = model.shard(vit_ref.init(jax.random.key(0), cfg))
        state = model.init_opt_state(optimizer, params)
        images, labels = model.shard_batch(*verify.make_batch(cfg, 8))
        step = model.train_step(optimizer)
        led = ledger.measure(step, params, state, images, labels, mesh=model.mesh)
        rows = sorted(led.summary().items())
        print(f"{case.name:<20}", "; ".join(f"{k} {','.join(a)} ×{t.count}" for (k, a), t in rows))
        for c in led.collectives if args.detail else ():
            print(f"    {c.kind:<19} {','.join(c.axes):<10} ×{c.count:<3} {c.dtypes} {c.shapes}")


if __name__ == "__main__":
    main()
