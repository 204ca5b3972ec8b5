"""``shardkit bench``: the flags, and the runs they choose: strategies against XLA's automatic
partitioner (``run.bench``; the GPT's: ``run.lm_bench``), one device's training throughput
(``--chip``: ``run.throughput``) or one device's attention kernels (``--attention``:
``run.attention_bench``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from shardkit.cli import (
    MODEL_FLAGS,
    TPU_FLAG_SETS,
    UsageError,
    add_model_opts,
    add_plan_opts,
    check_plot,
    model_config,
    plan_from_args,
    plan_given,
    setup_devices,
    with_matrix_options,
)
from shardkit.mesh import REMAT_POLICIES, parse_mesh


def add_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="time shardkit vs XLA's automatic partitioner vs 1 device")
    add_model_opts(bench, 32, "4 layers, dim 256, 8 heads, mlp 1024, 32px, patch 4")
    add_plan_opts(bench)
    bench.add_argument("--strategies", metavar="LIST", help="comma-separated names (default: all)")
    bench.add_argument("--steps", type=int, default=5, help="timed rounds (default 5)")
    bench.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    bench.add_argument("--plot", metavar="FILE.png", help="draw time and bytes per strategy")
    chip = bench.add_argument_group("one device's throughput (--chip)")
    chip.add_argument("--chip", action="store_true", help="vit_ref vs the sharded ViT on the "
                      "first device: img/s, MFU, memory (default B/16, bfloat16)")  # fmt: skip
    chip.add_argument("--batches", default="32,64,128,256", help="comma-separated batch sizes")
    chip.add_argument("--remats", default="dots",
                      help=f"comma-separated remat policies of {REMAT_POLICIES}")  # fmt: skip
    chip.add_argument("--micro-batch", type=int, metavar="N", help="run a batch larger than N "
                      "as batch/N micro-batches of N, gradients accumulated")  # fmt: skip
    bench.add_argument("--schedules", action="store_true", help="every pipeline schedule on "
                       "the plan's stage axis: time, bubble, matmul FLOPs (--mesh ...,stage=S "
                       "--microbatches M)")  # fmt: skip
    pod = bench.add_argument_group("compiled for a TPU slice, not run (--target)")
    pod.add_argument("--target", metavar="TOPOLOGY", help="compile each strategy's step, "
                     "shardkit's and XLA auto's, for a TPU slice (e.g. v5e:2x4; needs libtpu): "
                     "bytes, hidden share, memory, estimated ms")  # fmt: skip
    pod.add_argument("--tpu-flags", choices=TPU_FLAG_SETS,
                     help="with --target: libtpu's flags (maxtext: MaxText's v5e overlap "
                     "flags)")  # fmt: skip
    att = bench.add_argument_group("one device's attention (--attention)")
    att.add_argument("--attention", action="store_true", help="forward + backward per length, "
                     "shardkit's kernels vs splash and XLA (b 1, 8 heads × 128, bf16)")  # fmt: skip
    att.add_argument("--tokens", help="comma-separated lengths (4k-32k on a TPU, else 512,1024)")
    att.add_argument("--ring", type=int, default=1, metavar="N",
                     help="also a device's share of a causal zigzag ring of N")  # fmt: skip


def _bench_cases(args: argparse.Namespace) -> list[Any]:
    from shardkit.run import bench
    from shardkit.run.verify import Case

    if plan_given(args):
        if args.strategies:
            raise UsageError("give either --strategies or plan options (--mesh ...), not both.")
        return [Case("custom", plan_from_args(args))]
    cases = bench.strategies(args.devices)
    chosen = _chosen(args.strategies, {case.name: case for case in cases})
    return with_matrix_options(list(chosen.values()), args)


def _chosen(strategies: str | None, named: dict[str, Any]) -> dict[str, Any]:
    """The ``--strategies`` of ``named`` (all if not given; names case-insensitive)."""
    if not strategies:
        return named
    by_name = {name.lower(): name for name in named}
    wanted = [name.strip() for name in strategies.split(",") if name.strip()]
    unknown = [name for name in wanted if name.lower() not in by_name]
    if unknown or not wanted:
        raise UsageError(f"unknown strategy {unknown[0] if unknown else '(none)'!r}; "
                         f"choose from {', '.join(named)}.")  # fmt: skip
    return {by_name[w.lower()]: named[by_name[w.lower()]] for w in wanted}


def _check_bench_flags(args: argparse.Namespace) -> None:
    if args.steps < 1 or args.warmup < 0:
        raise UsageError(
            f"--steps must be >= 1 and --warmup >= 0, got {args.steps}, {args.warmup}."
        )
    check_plot(args)


def _progress(what: str) -> None:
    print(f"bench: {what}", file=sys.stderr, flush=True)


def run_bench(args: argparse.Namespace) -> int:
    from shardkit.run import bench

    _check_bench_flags(args)
    if args.target:
        return _run_target_bench(args)
    if args.tpu_flags:
        raise UsageError("--tpu-flags sets the TPU compiler's flags: it needs --target.")
    if args.chip:
        return _run_chip_bench(args)
    if args.attention:
        return _run_attention_bench(args)
    setup_devices(args.devices)
    if args.schedules:
        return _run_schedules_bench(args)
    cfg = model_config(args, bench.DEFAULT_MODEL)
    cases = _bench_cases(args)
    result = bench.run(cfg, cases, args.batch, args.steps, args.warmup, _progress)
    if args.plot:
        bench.plot(result, args.plot)
    print(json.dumps(result) if args.json else bench.format_table(result, args.markdown))
    return 0


def _run_target_bench(args: argparse.Namespace) -> int:
    """``bench --target``: the strategies compiled for a TPU slice (``run.target_bench``)."""
    from shardkit.run import target

    if args.chip or args.attention or args.schedules or args.plot:
        raise UsageError("--target compiles the strategies for a TPU slice: give no --chip, "
                         "--attention, --schedules or --plot.")  # fmt: skip
    target.prepare_environment()  # before JAX starts: the CPU backend, libtpu shareable
    from shardkit.run import bench, target_bench

    chips = target.topology_devices(args.target).size
    if not args.mesh:
        args.devices = chips  # the matrix's meshes over the slice's chips
    cfg = model_config(args, bench.DEFAULT_MODEL)
    result = target_bench.run(cfg, _bench_cases(args), args.batch, args.target,
                              args.tpu_flags or "default", _progress)  # fmt: skip
    print(json.dumps(result) if args.json else target_bench.format_table(result, args.markdown))
    return 0


def _run_schedules_bench(
    args: argparse.Namespace, lm_cfg: Any = None, lm_plan: Any = None, lm_batch: int = 0
) -> int:
    """``bench --schedules``: every pipeline schedule on the given plan (``run.pipeline_bench``);
    the ViT's, or the GPT's (``lm_cfg``, ``lm_plan`` at ``lm_batch``)."""
    from shardkit.run import bench, pipeline_bench

    if args.strategies or args.chip:
        raise UsageError("--schedules times one plan's schedules: give no --strategies or --chip.")
    if lm_plan is not None:
        pipeline_bench.check_stages(lm_plan.mesh["stage"])
        build, chosen = pipeline_bench.gpt_builder(lm_cfg, lm_plan, lm_batch)
        title = pipeline_bench.title(f"GPT dim {lm_cfg.dim}", lm_plan.mesh, lm_batch)
    else:
        pipeline_bench.check_stages(parse_mesh(args.mesh)["stage"] if args.mesh else 1)
        args.pp = args.pp or "gpipe"  # each schedule replaces it
        plan = plan_from_args(args)
        cfg = model_config(args, bench.DEFAULT_MODEL)
        build, chosen = pipeline_bench.vit_builder(cfg, plan, args.batch)
        title = pipeline_bench.title(f"ViT dim {cfg.dim}", plan.mesh, args.batch)
    result = pipeline_bench.run(build, chosen, title, args.steps, args.warmup, _progress)
    print(json.dumps(result) if args.json else pipeline_bench.format_table(result, args.markdown))
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(f"{flag} takes positive integers separated by commas, got {text!r}.")
    return values


def _run_chip_bench(args: argparse.Namespace) -> int:
    """``bench --chip``: one device's throughput table (``run.throughput``)."""
    from shardkit.run import throughput

    if plan_given(args) or args.strategies:
        raise UsageError("--chip runs one device: give no --mesh, plan options or --strategies.")
    batches = _int_list(args.batches, "--batches")
    remats = [r.strip() for r in args.remats.split(",") if r.strip()]
    unknown = [r for r in remats if r not in REMAT_POLICIES]
    if unknown or not remats:
        raise UsageError(
            f"--remats takes policies of {', '.join(REMAT_POLICIES)}, got {args.remats!r}."
        )
    if args.variant is None and args.dim is None:
        args.variant, args.dtype = "B/16", args.dtype or "bfloat16"
    cfg = model_config(args, head_zeroinit=False)
    if args.micro_batch is not None and args.micro_batch < 1:
        raise UsageError(f"--micro-batch must be a positive integer, got {args.micro_batch}.")
    try:
        for batch in batches:
            throughput.micro_batches(batch, args.micro_batch)
    except ValueError as err:
        raise UsageError(str(err)) from None
    result = throughput.run(cfg, batches, remats, steps=args.steps, warmup=args.warmup,
                            progress=_progress, layers=args.layers or "scan",
                            kernel=args.kernel or "auto", micro_batch=args.micro_batch)  # fmt: skip
    if args.plot:
        throughput.plot(result, args.plot)
    print(json.dumps(result) if args.json else throughput.format_table(result))
    return 0


def _run_attention_bench(args: argparse.Namespace) -> int:
    """``bench --attention``: one device's attention per length (``run.attention_bench``)."""
    from shardkit.run import attention_bench

    model_given = args.variant or any(getattr(args, f) is not None for f in MODEL_FLAGS)
    if plan_given(args) or args.strategies or args.chip or model_given:
        raise UsageError("--attention times one device's attention: give no model, plan, "
                         "--strategies or --chip.")  # fmt: skip
    tokens = _int_list(args.tokens, "--tokens") if args.tokens else attention_bench.default_tokens()
    attention_bench.check(tokens, args.ring)
    kernels = attention_bench.default_kernels(args.kernel or "auto")
    result = attention_bench.run(tokens, kernels, args.ring, steps=args.steps,
                                 warmup=args.warmup, progress=_progress)  # fmt: skip
    if args.plot:
        attention_bench.plot(result, args.plot)
    print(json.dumps(result) if args.json else attention_bench.format_table(result, args.markdown))
    return 0


def run_lm_bench(args: argparse.Namespace, cfg: Any, batch: int, plan: Any) -> int:
    """``bench --model gpt | moe-gpt``: the given plan, or the default plans (``--strategies``)."""
    from shardkit.run import bench, lm, lm_bench

    _check_bench_flags(args)
    if plan is not None and args.strategies:
        raise UsageError("give either --strategies or plan options (--mesh ...), not both.")
    cfg = dataclasses.replace(lm_bench.bench_config(cfg), **args.lm_dims)  # given dims win
    if args.schedules:
        if plan is None:
            raise UsageError("--schedules needs a plan with a stage axis (--mesh ...,stage=S).")
        layers = args.lm_dims.get("layers", 4)
        return _run_schedules_bench(args, dataclasses.replace(cfg, layers=layers), plan, batch)
    plans = _chosen(args.strategies, lm.default_plans(cfg)) if plan is None else {"custom": plan}
    result = lm_bench.run(cfg, plans, batch, args.steps, args.warmup, _progress)
    if args.plot:
        bench.plot(result, args.plot)
    print(json.dumps(result) if args.json else lm_bench.format_table(result, args.markdown))
    return 0
