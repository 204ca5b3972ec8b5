"""Your own mixture-of-experts block on ``ShardedModel``: experts over an ``expert`` axis,
verified against the one-token-at-a-time reference ``moe_ref``.

The block: h = x · proj, h + MoE(h) (E SwiGLU experts behind a top-k router,
``moe.moe_layer``), a linear head, squared error plus 0.01 · load balance + 0.001 · router
z-loss. Sharding is declared with logical names and one rules table: the experts' leading dim
is ``expert`` (mapped to the mesh axis ``expert``), their hidden dim ``mlp`` (over ``model``),
the batch is split over data × expert and the tokens over seq
(``token_axes=("expert", "seq")``: the dense weights' gradients are synced over all three, the
experts' own over data and seq only). The reference routes the same groups of tokens (one
device's tokens each), so drops agree exactly.

    python examples/moe_block.py [--mesh data=2,expert=4] [--top-k 2] [--capacity-factor 1.0]
                                 [--dispatch all_to_all|ring] [--fsdp]
"""

import argparse

import shardkit

shardkit.set_cpu_devices(8)  # before any other JAX call

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe_ref  # noqa: E402
from shardkit import ShardedModel, moe, testing  # noqa: E402

E, D, F = 8, 16, 32  # experts, model dim, expert hidden dim
B, T = 8, 16  # sequences, tokens per sequence
ALPHA, BETA = 1e-2, 1e-3  # load-balance and z-loss weights

# --8<-- [start:block]
PARAM_AXES = {
    "moe": {"router": ("embed", None), "gate": ("expert", "embed", "mlp"),
            "up": ("expert", "embed", "mlp"), "down": ("expert", "mlp", "embed")},
    "proj": (None, "embed"),
    "head": ("embed", None),
}  # fmt: skip


def sharded(mesh, cfg, fsdp=False, dispatch_by="all_to_all"):
    """The block on ``mesh``: tokens over data × expert and seq, experts over expert, the
    expert hidden dim over model; ``fsdp``: the embed dims over data."""
    big = lambda a: a if mesh.shape[a] > 1 else None  # noqa: E731

    def loss_local(p, x, y):
        h = jnp.einsum("btd,de->bte", x, p["proj"])
        out, aux = moe.moe_layer(h, p["moe"], cfg, expert_axis=big("expert"), tp=big("model"),
                                 batch_axes=("data", "expert"), seq_axes=("seq",),
                                 dispatch_by=dispatch_by)  # fmt: skip
        pred = jnp.einsum("btd,de->bte", h + out, p["head"])
        groups = mesh.shape["data"] * mesh.shape["expert"] * mesh.shape["seq"]
        share = jnp.sum((pred - y) ** 2) / (y.size * groups)  # the global mean
        share = share + ALPHA * aux.load_balance + BETA * aux.router_z
        return share, {"tokens_per_expert": aux.tokens_per_expert, "dropped": aux.dropped}

    rules = {"expert": "expert", "mlp": "model"} | ({"embed": "data"} if fsdp else {})
    tokens = P(("data", "expert"), "seq")
    return ShardedModel(mesh, PARAM_AXES, rules, loss_local, batch_specs=(tokens, tokens),
                        token_axes=("expert", "seq"), aux=True)  # fmt: skip


# --8<-- [end:block]


def twin(p, x, y, cfg, grouping):
    """The unsharded block (``moe_ref``): (loss, the reference's counts)."""
    h = jnp.einsum("btd,de->bte", x, p["proj"], precision=moe_ref.HIGHEST)
    out, aux = moe_ref.layer(p["moe"], h, cfg, grouping)
    pred = jnp.einsum("btd,de->bte", h + out, p["head"], precision=moe_ref.HIGHEST)
    return jnp.mean((pred - y) ** 2) + ALPHA * aux["load_balance"] + BETA * aux["router_z"], aux


def init(seed=0, e=E, d=D, f=F):
    k = jax.random.split(jax.random.key(seed), 6)
    return {
        "moe": {
            "router": 2.0 * jax.random.normal(k[0], (d, e)) / np.sqrt(d),
            "gate": jax.random.normal(k[1], (e, d, f)) / np.sqrt(d),
            "up": jax.random.normal(k[2], (e, d, f)) / np.sqrt(d),
            "down": jax.random.normal(k[3], (e, f, d)) / np.sqrt(f),
        },
        "proj": jax.random.normal(k[5], (d, d)) / np.sqrt(d),
        "head": jax.random.normal(k[4], (d, d)) / np.sqrt(d),
    }


def batch(seed=1, b=B, t=T, d=D):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (b, t, d)), jax.random.normal(ky, (b, t, d))


def groups(mesh):
    """(batch blocks, token blocks): the devices that route tokens apart."""
    return mesh.shape["data"] * mesh.shape["expert"], mesh.shape["seq"]


def verify(mesh, cfg, fsdp=False, dispatch_by="all_to_all"):
    """(comparison with the reference, the sharded step's metrics, the reference's counts)."""
    model = sharded(mesh, cfg, fsdp, dispatch_by)
    params, (x, y) = init(), batch()
    metrics = {}

    def loss_and_grads(p, x, y):
        out, grads = model.loss_and_grads(p, x, y)
        metrics.update(out)
        return out["loss"], grads

    reference = lambda p, x, y: twin(p, x, y, cfg, groups(mesh))[0]  # noqa: E731
    check = testing.compare_sharded(loss_and_grads, reference, params, x, y, place=model.shard)
    with testing.parity_precision():
        _, want = twin(params, x, y, cfg, groups(mesh))
    return check, metrics, want


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=2,expert=4")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", default="1.0", help="a number, or none (dropless)")
    parser.add_argument("--dispatch", default="all_to_all", choices=moe.DISPATCHES)
    parser.add_argument("--fsdp", action="store_true", help="split the embed dims over data")
    args = parser.parse_args()
    factor = None if args.capacity_factor == "none" else float(args.capacity_factor)
    try:
        cfg = moe.MoE(E, args.top_k, factor)
        mesh = shardkit.make_mesh(shardkit.parse_mesh(args.mesh))
    except (ValueError, shardkit.PlanError) as err:
        parser.error(str(err))
    check, got, want = verify(mesh, cfg, args.fsdp, args.dispatch)
    check.assert_ok()
    print(f"sharded == moe_ref: worst {check.worst[0]} at {check.worst[1]:.1e}")
    print(f"dropped assignments: {int(got['dropped'])} (reference {int(want['dropped'])})")
    print(f"tokens per expert: {np.asarray(got['tokens_per_expert'], int).tolist()}")


if __name__ == "__main__":
    main()
