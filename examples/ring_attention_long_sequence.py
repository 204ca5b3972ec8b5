"""Ring attention on a long sequence whose length does not divide the device count.

Tokens are split over a ``seq`` axis of n = 8 CPU devices. Each device keeps its query block;
key/value blocks travel the ring by ``ppermute`` (n − 1 hops) and an online softmax merges them.

1. Correctness: ``sequence.sharded_attention(..., mode="ring")`` (pads t to a multiple of n,
   masks the padded keys, runs ``shard_map``, slices back) against plain unsharded attention:
   the outputs and dq, dk, dv under the non-linear loss sum(sin(out)).
2. Memory: the same gradient, written the way a model would (``attention_ring`` inside its own
   ``shard_map`` on padded blocks with a key mask), compiled three ways -- ring with the
   hand-written backward (custom VJP), ring differentiated by autodiff, and unsharded attention
   -- and XLA's per-device temp bytes (``compiled.memory_analysis()``) printed for each.

    python examples/ring_attention_long_sequence.py [--tokens 4099 --heads 4 --head-dim 32]
                                                    [--devices 8] [--memory-only]
"""

import argparse

import shardkit

shardkit.set_cpu_devices(8)  # before any other JAX call: the backend fixes its device count once

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardkit import sequence, testing  # noqa: E402
from vit_ref.model import attention_core  # noqa: E402  (plain softmax attention, the twin)

TOL = 1e-5


def sin_loss(out: jax.Array) -> jax.Array:
    """Non-linear, so dq, dk, dv depend on every output value (sum(out) would not test much)."""
    return jnp.sum(jnp.sin(out))


def check_against_plain(q: np.ndarray, k: np.ndarray, v: np.ndarray, mesh) -> float:
    """Worst relative L2 error of out, dq, dk, dv: sharded ring vs unsharded attention."""

    def ring(q, k, v):  # pads t to a multiple of n, runs shard_map, slices back
        return sequence.sharded_attention(q, k, v, mesh, mode="ring")[0]

    def out_and_grads(attention) -> dict[str, jax.Array]:
        loss = lambda q, k, v: sin_loss(attention(q, k, v))  # noqa: E731
        dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        return {"out": jax.jit(attention)(q, k, v), "dq": dq, "dk": dk, "dv": dv}

    got, want = out_and_grads(ring), out_and_grads(attention_core)
    errors = {name: testing.max_error(got[name], want[name]) for name in want}
    for name, err in errors.items():
        print(f"  {name:<4} relative L2 error {err:.2e}")
    testing.assert_trees_close(got, want, tol=TOL, what="ring vs plain attention")
    return max(errors.values())


def ring_grad(ring, mesh):
    """jit(grad) of sin_loss through ``ring`` inside shard_map, on padded, masked blocks."""
    spec = P(None, "seq", None, None)

    def loss_local(q_block, k_block, v_block, valid_block):
        # q, k, v[B, T_seq, H, K] with t padded to a multiple of n; valid[T_seq] marks real tokens.
        out, _ = ring(q_block, k_block, v_block, valid_block, "seq")
        # Padded query rows still produce outputs: leave them out of the loss.
        partial = sin_loss(jnp.where(valid_block[None, :, None, None], out, 0.0))
        return jax.lax.psum(partial, "seq")  # loss{U_seq} -> loss

    sharded = jax.shard_map(
        loss_local, mesh=mesh, in_specs=(spec, spec, spec, P("seq")), out_specs=P()
    )

    def loss(q, k, v):
        (q, _), (k, valid), (v, _) = (sequence.pad_tokens(x, mesh.shape["seq"]) for x in (q, k, v))
        return sharded(q, k, v, valid)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def temp_bytes(jitted, shape: tuple[int, ...]) -> int:
    """Per-device temp buffer bytes of the compiled program (compiles; runs nothing)."""
    arg = jax.ShapeDtypeStruct(shape, jnp.float32)
    return jitted.lower(arg, arg, arg).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4099, help="4099 is prime")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--devices", type=int, default=8, help="size of the seq axis (1-8)")
    parser.add_argument(
        "--memory-only", action="store_true", help="skip the check; only compile and measure"
    )
    args = parser.parse_args()

    mesh = shardkit.make_mesh({"seq": args.devices})
    shape = (args.batch, args.tokens, args.heads, args.head_dim)
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=shape).astype(np.float32) for _ in range(3))
    n, t = args.devices, args.tokens
    print(
        f"b,t,h,k = {shape}; seq={n}: {-(-t // n)} tokens per device, {-(-t // n) * n - t} padded"
    )

    if not args.memory_only:
        print("ring (sharded_attention) vs plain attention, out and grads of sum(sin(out)):")
        worst = check_against_plain(q, k, v, mesh)
        print(f"max relative error {worst:.2e} <= {TOL:g}: ring == plain")

    temp = {
        "ring, custom VJP": temp_bytes(ring_grad(sequence.attention_ring, mesh), shape),
        "ring, autodiff": temp_bytes(ring_grad(sequence.attention_ring_autodiff, mesh), shape),
        "unsharded": temp_bytes(
            jax.jit(jax.grad(lambda q, k, v: sin_loss(attention_core(q, k, v)), (0, 1, 2))), shape
        ),
    }
    print(f"temp memory per device of jit(grad), memory_analysis(), n={n}:")
    for name, size in temp.items():
        print(f"  {name:<18} {size / 2**20:9.2f} MiB")


if __name__ == "__main__":
    main()
