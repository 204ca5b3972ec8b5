"""Draws the pipelined ViT's train-step temp memory per device against M, per schedule.

    python docs/measure/pipeline_memory.py      # ~3 minutes on 2 cores

The model and plan of ``tests/models/test_vit_pipeline.py`` (a 2-layer ViT, dim 16, on stage=2, 4
examples per microbatch, so the batch grows with M); temp bytes from ``memory_analysis`` of the
compiled train step (never run). Output: ``docs/img/pipeline_memory.png`` and the numbers on
stdout.
"""

import pathlib
import sys

import shardkit

shardkit.set_cpu_devices(8)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(DOCS.parent / "tests" / "models"))
import test_vit_pipeline as case  # noqa: E402

MICRO = (2, 4, 8, 16)


def main() -> None:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for pp, colour in (("gpipe", "#4c72b0"), ("1f1b", "#55a868"), ("zb", "#dd8452")):
        temp = {m: case._temp_bytes(pp, m) for m in MICRO}
        print(pp, ", ".join(f"M={m}: {b:,} B" for m, b in temp.items()), flush=True)
        ax.plot(MICRO, [temp[m] / 1024 for m in MICRO], "o-", color=colour, label=pp)
    ax.set_xlabel("microbatches M (4 examples each; S = 2)")
    ax.set_ylabel("temp KiB per device")
    ax.set_xticks(MICRO)
    ax.set_title("Pipelined ViT train step: temp memory (memory_analysis)")
    ax.legend()
    fig.tight_layout()
    out = DOCS / "img" / "pipeline_memory.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
