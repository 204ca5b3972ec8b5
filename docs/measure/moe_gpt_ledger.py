"""The collectives of the MoE GPT's clipped train step (``shardkit.models.gpt``, 8 experts),
measured from the compiled program, on the expert-parallel meshes of docs/strategies/moe.md.

    python docs/measure/moe_gpt_ledger.py [--mesh data=2,expert=4] [--capacity-factor 1.25]

Model: the example's MoE GPT (dim 64, 8 heads, 2 KV heads, 2 layers, 64 tokens, 8 experts of
hidden 64, top-2); batch 8; zigzag layout over seq; AdamW, clipped. Counts are executions per
step (inside the layer scan: once per layer), bytes are sent per device
(``shardkit.comm.ledger.format_table``).
"""

import argparse

import shardkit

shardkit.set_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from shardkit.comm import ledger  # noqa: E402
from shardkit.models import gpt  # noqa: E402
from shardkit.parallel import moe  # noqa: E402
from shardkit.parallel.sequence import layouts  # noqa: E402

MESHES = ("data=2,expert=4", "data=2,expert=2,model=2", "expert=2,seq=4", "expert=8")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", help="one mesh (default: the page's four)")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    args = parser.parse_args()
    experts = moe.MoE(8, 2, args.capacity_factor)
    cfg = gpt.moe_config(experts)
    params = gpt.init(0, cfg)
    x, y = gpt.windows(np.random.default_rng(0), 8, cfg.tokens)
    for flag in [args.mesh] if args.mesh else MESHES:
        mesh = shardkit.make_mesh(shardkit.parse_mesh(flag))
        plan = gpt.GPTPlan(shardkit.parse_mesh(flag), "zigzag")
        model = gpt.sharded_gpt(mesh, cfg, plan)
        optimizer = optax.adamw(1e-3)
        step = model.train_step(optimizer, clip_norm=1.0)
        p = model.shard(params)
        state = model.init_opt_state(optimizer, p)
        n_seq = mesh.shape["seq"]
        batch = model.shard_batch(*(layouts.to_layout(a, n_seq, "zigzag") for a in (x, y)))
        led = ledger.measure(step, p, state, *batch, mesh=mesh)
        print(
            f"--- {flag}: capacity {experts.capacity(8 * 64 // mesh.size * mesh.shape['model'])}"
            " slots per expert and group"
        )
        print(ledger.format_table(led))
        jax.clear_caches()


if __name__ == "__main__":
    main()
