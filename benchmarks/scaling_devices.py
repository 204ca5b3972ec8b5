"""Strong scaling: step time and bytes against device count, DP, TP and ring, fixed global batch.

The ``shardkit bench`` default model (4 layers, dim 256, 8 heads, mlp 1024, 65 tokens) and
global batch 32 on the first n = 1, 2, 4, 8 CPU devices (``data=n``, ``model=n``,
``seq=n`` ring; n = 1 is a one-device shard_map, no collectives). All contenders of
``shardkit bench`` are measured per point; the plot shows shardkit's step time and bytes per
device, and XLA auto's beside them. NOTE: the 8 CPU devices share this machine's 2 cores, so
more devices cannot be faster here; the curve shows the overhead of the split, not speed-up.

    python benchmarks/scaling_devices.py [--plot FILE.png] [--markdown FILE.md]
"""

import argparse
import json

import shardkit

shardkit.set_cpu_devices(8)

import vit_ref  # noqa: E402
from shardkit.mesh import Plan  # noqa: E402
from shardkit.run import bench  # noqa: E402
from shardkit.run.verify import Case  # noqa: E402

SERIES = {
    "DP": lambda n: Plan({"data": n}),
    "TP": lambda n: Plan({"model": n}),
    "ring": lambda n: Plan({"seq": n}, sp="ring") if n > 1 else Plan({"seq": 1}),
}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    for name in SERIES:
        rows = [r for r in result["rows"] if r["strategy"].startswith(name + " ")]
        n = [int(r["strategy"].split("n=")[1]) for r in rows]
        ax_t.plot(n, [1e3 * r["shardkit_step_s"] for r in rows], "o-", label=f"{name} shardkit")
        ax_t.plot(n, [1e3 * r["auto_step_s"] for r in rows], "x--", label=f"{name} auto")
        ax_b.plot(n, [r["shardkit_bytes_sent"] / 1e6 for r in rows], "o-", label=f"{name} shardkit")
        ax_b.plot(n, [r["auto_bytes_sent"] / 1e6 for r in rows], "x--", label=f"{name} auto")
    ax_t.set(xlabel="devices", ylabel="step time, median (ms)", xscale="log", xticks=[1, 2, 4, 8])
    ax_b.set(xlabel="devices", ylabel="MB sent per device per step", xscale="log",
             xticks=[1, 2, 4, 8])  # fmt: skip
    for ax in (ax_t, ax_b):
        ax.set_xticklabels(["1", "2", "4", "8"])
        ax.legend(fontsize=7)
    fig.suptitle("fixed global batch 32; 8 CPU devices share 2 cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--plot")
    parser.add_argument("--markdown", help="write the table here (Markdown)")
    args = parser.parse_args()
    cfg = vit_ref.ViTConfig(**bench.DEFAULT_MODEL, head_zeroinit=False)
    cases = [Case(f"{name} n={n}", make(n)) for name, make in SERIES.items() for n in (1, 2, 4, 8)]
    result = bench.run(cfg, cases, bench.DEFAULT_BATCH, steps=args.steps, progress=print)
    table = bench.format_table(result, markdown=True)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
