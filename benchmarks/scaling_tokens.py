"""Attention cost as the sequence grows: ring vs Ulysses vs all-gathered K/V, n = 8 devices.

One attention layer's forward + backward (a non-linear loss of the output), q, k, v split over
``seq`` as [b, T/n, h, k] per device, for T = 1k .. 8k tokens. Per mode: the median step time
(interleaved rounds), per-device temp memory (``memory_analysis``) and bytes sent per device
(the ledger), next to the formula:

  ring         K/V go round the ring: 2(n−1) block permutes forward, 4(n−1)+... backward;
               temp memory O(T/n · key_chunk) per device (flash-tiled hops).
  Ulysses      4 all-to-alls forward, 4 backward, (n−1)/n of each block; full-T attention on
               h/n heads: temp O(T² · h/n) scores.
  all-gather   every device gathers all of K and V ((n−1)/n · T·h·k each), attends its T/n
               queries to all T keys: temp O(T/n · T · h) scores; backward reduce-scatters dK, dV.

    python benchmarks/scaling_tokens.py [--tokens 1024,2048,4096,8192] [--plot FILE.png]
        [--markdown FILE.md]
"""

import argparse
import json
import statistics
import time

import shardkit

shardkit.set_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardkit import collectives, ledger, sequence  # noqa: E402

N, B, H, K = 8, 1, 8, 32
MESH = shardkit.make_mesh({"seq": N})
SPEC = P(None, "seq", None, None)


def attention_all_gathered(q, k, v):
    """The naive split: gather all keys and values, attend local queries to all of them."""
    k_all = collectives.all_gather(k, "seq", axis_dim=1, tiled=True)
    v_all = collectives.all_gather(v, "seq", axis_dim=1, tiled=True)
    return sequence.attention_local(q, k_all, v_all)[0]


MODES = {
    "ring": lambda q, k, v: sequence.attention_ring(q, k, v, None, "seq")[0],
    "ulysses": lambda q, k, v: sequence.attention_ulysses(q, k, v, None, "seq")[0],
    "all-gather": attention_all_gathered,
}


def step(mode):
    def loss(q, k, v):
        out = jax.shard_map(MODES[mode], mesh=MESH, in_specs=(SPEC,) * 3, out_specs=SPEC)(q, k, v)
        return jnp.sum(jnp.tanh(out))  # non-linear, so every gradient path is exercised

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def measure(tokens: int, rounds: int) -> list[dict]:
    sharding = NamedSharding(MESH, SPEC)
    keys = jax.random.split(jax.random.key(tokens), 3)
    qkv = [jax.device_put(jax.random.normal(k, (B, tokens, H, K)), sharding) for k in keys]
    compiled = {m: step(m).lower(*qkv).compile() for m in MODES}
    times = {m: [] for m in MODES}
    for r in range(rounds + 1):
        for m, fn in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*qkv))
            if r:  # the first round warms up
                times[m].append(time.perf_counter() - t0)
    rows = []
    for m, fn in compiled.items():
        led = ledger.ledger_of(fn, MESH)
        rows.append({"tokens": tokens, "mode": m, "step_s": statistics.median(times[m]),
                     "temp_bytes": led.memory.temp if led.memory else None,
                     "bytes_sent": led.total_bytes_sent()})  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| tokens | mode | fwd+bwd ms | temp MiB per device | MB sent per device |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ms, mib, mb = 1e3 * r["step_s"], r["temp_bytes"] / 2**20, r["bytes_sent"] / 1e6
        lines.append(f"| {r['tokens']} | {r['mode']} | {ms:.1f} | {mib:.1f} | {mb:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        t = [r["tokens"] for r in mine]
        axes[0].plot(t, [1e3 * r["step_s"] for r in mine], "o-", label=mode)
        axes[1].plot(t, [r["temp_bytes"] / 2**20 for r in mine], "o-", label=mode)
        axes[2].plot(t, [r["bytes_sent"] / 1e6 for r in mine], "o-", label=mode)
    titles = ["fwd+bwd time (ms)", "temp memory per device (MiB)", "MB sent per device"]
    for ax, title in zip(axes, titles, strict=True):
        ax.set(xlabel="tokens T", title=title, xscale="log", yscale="log")
        ax.legend()
    fig.suptitle(f"one attention layer, n={N} devices over seq, b={B}, h={H}, k={K}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,2048,4096,8192")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--plot", help="write the three panels here")
    parser.add_argument("--markdown", help="write the table here (Markdown)")
    args = parser.parse_args()
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows += measure(tokens, args.rounds)
        for r in rows[-len(MODES) :]:
            print(f"T={r['tokens']:>6}  {r['mode']:<10}  {1e3 * r['step_s']:8.1f} ms  "
                  f"temp {r['temp_bytes'] / 2**20:8.1f} MiB  sent {r['bytes_sent'] / 1e6:7.2f} MB",
                  flush=True)  # fmt: skip
    if args.plot:
        plot(rows, args.plot)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
