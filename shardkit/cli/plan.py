"""``shardkit plan``: the flags, and the ranking they ask for (``run.planner``)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any

from shardkit.cli import MODEL_FLAGS, TPU_FLAG_SETS, UsageError, add_model_opts, model_config
from shardkit.mesh import GRAD_SYNC, KERNELS, LAYER_LOOPS, REMAT_POLICIES


def default_cache() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "shardkit" / "plans"


def add_parser(sub: Any) -> None:
    plan = sub.add_parser("plan", help="rank the plans for a TPU slice, compiled for it from a CPU")
    add_model_opts(plan, 256, "B/16, bfloat16, unless --variant or sizes are given")
    plan.add_argument("--target", metavar="TOPOLOGY", required=True,
                      help="the TPU slice, e.g. v5e:2x4 or v5e:16x16 (needs libtpu)")  # fmt: skip
    plan.add_argument("--tpu-flags", choices=TPU_FLAG_SETS, default="default",
                      help="libtpu's flags (maxtext: MaxText's v5e overlap flags)")  # fmt: skip
    plan.add_argument("--keep", type=int, default=4, metavar="K",
                      help="compile the best plans on paper until K fit (default 4; 0: rank on "
                      "paper only); at most 4K compiles")  # fmt: skip
    plan.add_argument("--remat", choices=REMAT_POLICIES,
                      help="every plan's recompute policy (default: none, and a plan out of HBM "
                      "is compiled again with dots, then full)")  # fmt: skip
    plan.add_argument("--layers", choices=LAYER_LOOPS, default="scan")
    plan.add_argument("--kernel", choices=KERNELS, default="auto")
    plan.add_argument(
        "--grad-sync",
        choices=GRAD_SYNC,
        default="float32",
        help="every plan's gradient all-reduce dtype (bfloat16: half the bytes)",
    )
    plan.add_argument("--cache", metavar="DIR", help=f"compiled plans' facts (default "
                      f"{default_cache()}; 'none' to keep nothing)")  # fmt: skip
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--markdown", action="store_true", help="print the table as Markdown")


def run_plan(args: argparse.Namespace) -> int:
    from shardkit.run import target

    target.prepare_environment()  # before JAX starts: the CPU backend, libtpu shareable
    from shardkit.mesh import Plan
    from shardkit.run import planner

    if args.keep < 0:
        raise UsageError(f"--keep must be 0 or more, got {args.keep}.")
    if args.variant is None and all(getattr(args, f) is None for f in MODEL_FLAGS):
        args.variant, args.dtype = "B/16", args.dtype or "bfloat16"
    cfg = model_config(args)
    base = Plan(layers=args.layers, kernel=args.kernel, grad_sync=args.grad_sync)
    remats = (args.remat,) if args.remat else planner.REMAT_LADDER
    where = args.cache or str(default_cache())
    cache = planner.Cache(None if where == "none" else where)
    ranking = planner.rank(
        cfg, args.target, args.batch, base, keep=args.keep, remats=remats, cache=cache,
        flags=args.tpu_flags,
    )  # fmt: skip
    if args.json:
        print(json.dumps(planner.to_json(ranking)))
    else:
        print(planner.format_table(ranking, cfg, markdown=args.markdown))
    return 0 if ranking.best() or not args.keep else _none_fits(ranking)


def _none_fits(ranking: Any) -> int:
    """Exit 1, one sentence: no compiled plan fits (the closest one's memory named)."""
    from shardkit.run import planner, target

    sized = [e for e in ranking.compiled if e.fit is not None]
    closest = min(sized, key=lambda e: e.fit.peak_bytes, default=None)
    near = "" if closest is None else (
        f"; the closest, {planner.label(closest.plan)}, needs "
        f"{closest.fit.peak_bytes / target.GIB:.1f} GiB per chip")  # fmt: skip
    print(f"shardkit: error: none of the {len(ranking.compiled)} compiled plans fits the "
          f"chip's HBM{near}; give a smaller --batch or more chips.", file=sys.stderr)  # fmt: skip
    return 1
