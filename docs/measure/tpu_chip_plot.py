"""The picture on docs/performance.md: one v5e's ViT-B/16 train step, big_vision beside the
sharded ViT on the whole batch (stacked layers), and on per-layer params in micro-batches of 32,
from the committed results.

    python docs/measure/tpu_chip_plot.py   # writes docs/img/tpu_v5e_throughput.png
"""

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = pathlib.Path(__file__).parent / "results"
OUT = pathlib.Path(__file__).parents[1] / "img" / "tpu_v5e_throughput.png"


def rows(name, model):
    return [r for r in json.loads((RESULTS / name).read_text())["rows"] if r["model"] == model]


def main() -> None:
    big_vision = rows("tpu_v5e_bigvision.json", "big_vision (flax)")[1:]  # its batch 128
    big_vision += rows("tpu_v5e_bigvision_3.json", "big_vision (flax)")[1:]  # 256
    latest = rows("tpu_v5e_chip_unrolled_3.json", "shardkit")  # 32 and 256, re-measured
    whole = latest + [r for r in rows("tpu_v5e_chip_unrolled.json", "shardkit")
                      if r["batch"] in (64, 128)]  # fmt: skip
    big_vision += rows("tpu_v5e_bigvision_4.json", "big_vision (flax)")  # 32, re-measured
    per_layer = rows("tpu_v5e_chip_list_b32.json", "shardkit")  # 32: one micro-batch
    per_layer += rows("tpu_v5e_chip_list_accum.json", "shardkit")
    series = {
        "big_vision (flax), whole batch": big_vision,
        "ShardedViT, whole batch, stacked layers": whole,
        "ShardedViT, per-layer params, micro-batches of 32\n"
        "(--layers list --microbatches batch/32)": per_layer,
    }
    fig, (speed, mem) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    for label, points in series.items():
        points = sorted(points, key=lambda r: r["batch"])
        batches = [r["batch"] for r in points]
        speed.plot(batches, [r["images_per_s"] for r in points], "o-", label=label)
        mem.plot(batches, [r["temp_bytes"] / 1e9 for r in points], "o-", label=label)
    speed.set(xlabel="batch", ylabel="images / s (each step waited for)", xscale="log",
              title="throughput", ylim=(0, 1400))  # fmt: skip
    mem.set(xlabel="batch", ylabel="temp GB", xscale="log", title="temporaries (HBM 15.75 GB)")
    for ax in (speed, mem):
        ax.minorticks_off()
        ax.set_xticks([32, 64, 128, 256], ["32", "64", "128", "256"])
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("ViT-B/16 224 px, bf16, AdamW train step on one TPU v5e")
    fig.savefig(OUT, dpi=90)


if __name__ == "__main__":
    main()
