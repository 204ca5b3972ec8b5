"""The attention kernels' picture (docs/img/tpu_v5e_attention.png) from the chip's results:
TFLOP/s against tokens, bidirectional and causal, splash vs shardkit's kernels.

    python docs/measure/attention_plot.py docs/measure/results/tpu_v5e_attention_jnp.json
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(path: str, out: str = "docs/img/tpu_v5e_attention.png") -> None:
    with open(path) as f:
        rows = json.load(f)["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, causal in zip(axes, (False, True), strict=True):
        for name in sorted({r["contender"] for r in rows}):
            mine = [r for r in rows if r["contender"] == name and r["causal"] == causal]
            ax.plot([r["tokens"] for r in mine], [r["tflops"] for r in mine], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(("causal" if causal else "bidirectional") + " (b 1, 8 heads × 128, bf16)")
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TFLOP/s, forward + backward")
    axes[1].legend()
    fig.suptitle("One TPU v5e: attention per device (shardkit's ring at n = 1)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
