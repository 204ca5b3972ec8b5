"""The branch form against the phased form, side by side, on the bench's pipeline plans.

    python docs/measure/pipeline_forms.py            # CPU devices; ViT and GPT, stage=2, M=8

``shardkit bench --schedules`` times each schedule in the form the engine runs it (GPipe in
the branch form, the others phased: ``schedules.phased``). This script also compiles 1F1B,
interleaved, ZB-H1 and ZBV in the branch form (``schedules.phased`` replaced by the identity
while those contenders compile) and times all nine contenders in interleaved rounds in one
process, so the two forms meet the same machine load. Results: docs/strategies/pipeline.md
("Timed"), docs/measure/results/schedules/forms.md.
"""

import contextlib
import statistics

from shardkit import cli
from shardkit.parallel.pipeline import schedules
from shardkit.run import pipeline_bench

COMMANDS = (
    ["bench", "--schedules", "--mesh", "stage=2", "--microbatches", "8"],
    ["bench", "--schedules", "--model", "gpt", "--mesh", "stage=2", "--microbatches", "8"],
)


@contextlib.contextmanager
def branch_form():
    """Inside: the models build their schedules in the branch form."""
    phased = schedules.phased
    schedules.phased = lambda schedule: schedule
    try:
        yield
    finally:
        schedules.phased = phased


def both_forms(build, chosen, title, steps, warmup, progress):
    """``pipeline_bench.run``'s stand-in: each mixed schedule compiled in both forms, all
    timed in interleaved rounds; prints the Markdown table."""
    contenders = {}
    for name, _ in chosen:
        progress(f"compiling {name}")
        contenders[(name, "branch" if name == "gpipe" else "phased")] = build(name)[0]
        if name != "gpipe":
            with branch_form():
                contenders[(name, "branch")] = build(name)[0]
    for round_ in range(warmup + steps):
        for contender in contenders.values():
            seconds = contender.run()
            if round_ >= warmup:
                contender.times.append(seconds)
    ms = {key: statistics.median(c.times) * 1e3 for key, c in contenders.items()}
    gpipe = ms[("gpipe", "branch")]
    print(f"{title}; median of {steps} after {warmup}, ms (/GPipe)\n")
    print("| schedule | branch form | phased form |\n|---|---|---|")
    for name, _ in chosen:
        cells = [f"{ms[name, f]:.1f} ({ms[name, f] / gpipe:.2f})" if (name, f) in ms else "="
                 for f in ("branch", "phased")]  # fmt: skip
        print(f"| {name} | {' | '.join(cells)} |")
    print()
    return {"title": title, "rows": []}


def main() -> None:
    pipeline_bench.run = both_forms
    pipeline_bench.format_table = lambda result, markdown=False: ""
    for argv in COMMANDS:
        print(f"`shardkit {' '.join(argv)}`, both forms:\n")
        cli.main(argv)


if __name__ == "__main__":
    main()
