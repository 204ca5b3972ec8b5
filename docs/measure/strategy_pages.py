"""Writes the measured part of every strategy page: the ledger of the compiled train step next
to the cost model (``shardkit inspect``'s table) and its picture (``shardkit inspect --plot``).

    python docs/measure/strategy_pages.py [PAGE ...]   # all: ~1 minute on 2 cores; compiles only

Model: the ``shardkit verify`` default (2 layers, width 64, 8 heads, MLP 128, 32×32 images in
4×4 patches + a class token = 65 tokens), global batch 16, 8 CPU devices, AdamW. Output:
``docs/strategies/measured/<page>.txt`` (included by the pages) and ``<page>.png``.
"""

import pathlib
import sys

import shardkit

shardkit.set_cpu_devices(8)

import vit_ref  # noqa: E402
from shardkit.comm.plot import plot_report  # noqa: E402
from shardkit.mesh import Plan  # noqa: E402
from shardkit.models.vit import report  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parents[1] / "strategies" / "measured"
CFG = vit_ref.ViTConfig(
    image=32, patch=4, channels=3, classes=10, dim=64, depth=2, heads=8, mlp_dim=128, pool="tok",
    head_zeroinit=False,
)  # fmt: skip
PAGES = {
    "dp": ("--mesh data=8", Plan({"data": 8})),
    "fsdp": ("--mesh data=8 --fsdp", Plan({"data": 8}, fsdp=True)),
    "zero1": ("--mesh data=4,model=2 --zero 1", Plan({"data": 4, "model": 2}, zero=1)),
    "zero2": ("--mesh data=4,model=2 --zero 2", Plan({"data": 4, "model": 2}, zero=2)),
    "tp": ("--mesh model=8", Plan({"model": 8})),
    "megatron_sp": ("--mesh data=2,model=4 --sp megatron",
                    Plan({"data": 2, "model": 4}, sp="megatron")),
    "megatron_sp_seq": ("--mesh data=2,seq=2,model=2 --sp megatron",
                        Plan({"data": 2, "seq": 2, "model": 2}, sp="megatron")),
    "ring": ("--mesh data=2,seq=4 --sp ring", Plan({"data": 2, "seq": 4}, sp="ring")),
    "ulysses": ("--mesh data=2,seq=4 --sp ulysses", Plan({"data": 2, "seq": 4}, sp="ulysses")),
    "usp": ("--mesh data=2,seq=4 --sp usp --ulysses 2",
            Plan({"data": 2, "seq": 4}, sp="usp", ulysses=2)),
}  # fmt: skip


def main(pages: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for page in pages or PAGES:
        flags, plan = PAGES[page]
        result = report.inspect(CFG, plan, 16)
        text = f"$ shardkit inspect {flags}\n{result.format()}\n"
        (OUT / f"{page}.txt").write_text(text)
        plot_report(result, OUT / f"{page}.png")
        sent = result.measured_bytes_sent
        print(f"{page}: {sent:,.0f} bytes/device, contract {result.contract_ok}")


if __name__ == "__main__":
    main(sys.argv[1:])
