"""The ``shardkit`` command: ``verify`` (sharded == reference), ``inspect`` (the ledger) and
``train`` (a real training run), ``bench``, ``plan`` and ``launch``. Argument parsing, printing
and error reporting only; every command's work is in ``shardkit.run`` (``bench``'s and
``plan``'s flags: ``cli.bench``, ``cli.plan``).

Bad arguments print one line on stderr and exit 2; a failed verification or a diverged training
run exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from shardkit.mesh import (
    GRAD_SYNC,
    KERNELS,
    LAYER_LOOPS,
    PP_MODES,
    REMAT_POLICIES,
    SP_MODES,
    ZERO_LEVELS,
)

DEFAULT_MODEL = dict(
    image=32, patch=4, channels=3, classes=10, dim=64, depth=2, heads=8, mlp_dim=128, pool="tok"
)
MODEL_FLAGS = ("image", "patch", "channels", "classes", "dim", "depth", "heads", "mlp_dim")
# train: image, channels and classes follow the data unless given; 8×8 digits in 2×2 patches
# are 16 patches + a class token = 17 tokens.
TRAIN_MODEL = dict(patch=2, dim=64, depth=2, heads=8, mlp_dim=128, pool="tok")
LM_BATCH = 8  # the GPT's default global batch (of 64-token windows)
TPU_FLAG_SETS = ("default", "maxtext")  # run.target.TPU_FLAGS's names (--tpu-flags)


class UsageError(Exception):
    """A user mistake in the command line: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def add_model_opts(p: argparse.ArgumentParser, batch: int, about: str) -> None:
    g = p.add_argument_group(f"model (default: the ViT, {about})")
    g.add_argument("--model", choices=("vit", "gpt", "moe-gpt"), default="vit",
                   help="the ViT (default), or the Llama-style decoder on the Zen of Python, "
                   "dense or mixture-of-experts (the flags below --batch, and --dim, --depth "
                   "(its layers), --heads, --mlp-dim, apply to it)")  # fmt: skip
    g.add_argument(
        "--variant", help="mu, Ti/16, S/16, B/16, L/16 or H/14 (other flags override it)"
    )
    for name in MODEL_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), type=int, dest=name)
    g.add_argument("--pool", choices=("tok", "gap"))
    g.add_argument("--posemb", choices=("learn", "sincos2d"))
    g.add_argument("--dtype", choices=("float32", "bfloat16"))
    g.add_argument("--precision", choices=("wide", "big_vision"),
                   help="under bf16: wide keeps the residual stream and softmax float32 "
                   "(default), big_vision computes them in bf16")  # fmt: skip
    g.add_argument("--batch", type=int, help=f"global batch (default {batch}; the GPT: {LM_BATCH})")
    p.set_defaults(vit_batch=batch)
    g.add_argument("--experts", type=int, help="moe-gpt: experts per block (default 8)")
    g.add_argument("--top-k", type=int, default=2, help="moe-gpt: experts per token (2)")
    g.add_argument("--capacity-factor", default="1.25", help="moe-gpt: slots per expert as a "
                   "multiple of the even share, or none (dropless)")  # fmt: skip
    g.add_argument("--documents", action="store_true", help="gpt, moe-gpt: each line a packed "
                   "document (attention within it, positions from its start)")  # fmt: skip
    g.add_argument("--tied", action="store_true", help="gpt, moe-gpt: the head is the "
                   "embedding's transpose")  # fmt: skip


def add_plan_opts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan (verify: none given runs the default matrix)")
    g.add_argument("--devices", type=int, help="CPU devices (default: the --mesh's size, else 8)")
    g.add_argument("--mesh", help="e.g. data=2,seq=2,model=2 (omitted axes are 1)")
    g.add_argument("--sp", choices=SP_MODES)
    g.add_argument("--ulysses", type=int,
                   help="Ulysses factor of the seq axis for --sp usp, or for --sp megatron on a "
                   "seq axis (default there: a ring over seq)")  # fmt: skip
    g.add_argument("--fsdp", action="store_true", help="split params over data (= --zero 3)")
    g.add_argument("--zero", type=int, choices=ZERO_LEVELS, help="ZeRO level over data: "
                   "1 optimizer state split, 2 also gradients, 3 also params")  # fmt: skip
    g.add_argument("--remat", nargs="?", const="full", choices=REMAT_POLICIES,
                   help="what each block recomputes in backward: dots (keep the matmul "
                   "outputs) or full (the default when bare; re-gathers under FSDP)")  # fmt: skip
    g.add_argument("--layers", choices=LAYER_LOOPS, help="run the blocks as one lax.scan "
                   "(default), unrolled (faster on a TPU, slower to compile) or list "
                   "(unrolled over per-layer param arrays: AdamW fused per layer; not with "
                   "--pp)")  # fmt: skip
    g.add_argument("--kernel", choices=KERNELS, help="attention's compute: jnp, pallas (splash; "
                   "interpreted off a TPU) or auto (pallas on a TPU; the default)")  # fmt: skip
    g.add_argument("--pp", choices=PP_MODES, help="pipeline schedule over the stage axis "
                   "(needs stage > 1 in --mesh)")  # fmt: skip
    g.add_argument("--microbatches", type=int, metavar="M", help="per data shard (1): the "
                   "pipeline's, or without --pp gradient accumulation")  # fmt: skip
    g.add_argument("--virtual", type=int, metavar="V",
                   help="chunks per stage (interleaved; 1; zbv: 2)")  # fmt: skip
    g.add_argument("--overlap", nargs="?", const=True, default=False, choices=["bidirectional"],
                   help="hide communication under the matmuls: --sp megatron as collective "
                   "matmuls (rings one way, or both: bidirectional); --fsdp gathers each layer "
                   "one layer ahead and reduce-scatters it one behind; --zero 2 and DP sync "
                   "each layer's gradients under the next layer's backward")  # fmt: skip
    g.add_argument(
        "--grad-sync",
        choices=GRAD_SYNC,
        help="the dtype gradient all-reduces travel in (float32, the default; bfloat16: half "
        "the bytes on a TPU)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    small = "a 2-layer ViT, dim 64, 8 heads, 32px, patch 4"
    verify = sub.add_parser("verify", help="check sharded == vit_ref (logits, grads, one step)")
    add_model_opts(verify, 16, small)
    add_plan_opts(verify)
    verify.add_argument("--json", action="store_true", help="print one JSON object")
    inspect = sub.add_parser("inspect", help="collectives of the compiled train step vs the model")
    add_model_opts(inspect, 16, small)
    add_plan_opts(inspect)
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.add_argument("--hlo", metavar="FILE", help="write the compiled HLO text here")
    inspect.add_argument("--plot", metavar="FILE.png", help="draw the collective pattern here")
    inspect.add_argument(
        "--target",
        metavar="TOPOLOGY",
        help="compile for a TPU slice, e.g. v5e:2x4 (needs libtpu: shardkit[tpu]; no chip): "
        "the TPU compiler's collectives, and the memory against the chip's HBM",
    )
    inspect.add_argument("--tpu-flags", choices=TPU_FLAG_SETS,
                         help="with --target: libtpu's flags (maxtext: MaxText's v5e overlap "
                         "flags; default: libtpu's own)")  # fmt: skip
    _add_train_parser(sub)
    from shardkit.cli import bench

    bench.add_parser(sub)
    from shardkit.cli import plan

    plan.add_parser(sub)
    _add_launch_parser(sub)
    return parser


LAUNCHABLE = ("verify", "inspect", "train")


def _add_launch_parser(sub: Any) -> None:
    launch = sub.add_parser(
        "launch",
        help="run verify, inspect or train as P processes × D devices (jax.distributed)",
        usage="shardkit launch --procs P --devices-per-proc D [options] -- SUBCOMMAND [flags]",
    )
    launch.add_argument("--procs", type=int, required=True, metavar="P", help="processes")
    launch.add_argument("--devices-per-proc", type=int, required=True, metavar="D",
                        help="CPU devices each")  # fmt: skip
    launch.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: free)")
    launch.add_argument("--timeout", type=float, metavar="S", help="kill everything after S s")
    launch.add_argument("--watchdog", type=float, default=600, metavar="S",
                        help="a process without progress for S s exits (600)")  # fmt: skip
    launch.add_argument("--heartbeat", type=int, default=10, metavar="S", help="a peer silent "
                        "for S s is declared dead (10; processes started by hand)")  # fmt: skip
    launch.add_argument("--log-dir", metavar="DIR",
                        help="process-K.log files (default: a temp dir)")  # fmt: skip
    launch.add_argument("subcommand", nargs=argparse.REMAINDER, help="-- then the subcommand")


def _add_train_parser(sub: Any) -> None:
    from shardkit.run.train import TrainOptions

    d = TrainOptions()
    train = sub.add_parser("train", help="train the sharded ViT (default: digits, data=8)")
    add_model_opts(train, d.batch, "2 layers, dim 64, 8 heads, patch 2; size from the data")
    add_plan_opts(train)
    g = train.add_argument_group("training")
    g.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps ({d.steps})")
    g.add_argument("--out", metavar="DIR", help="run directory (default runs/train-<time>)")
    g.add_argument("--data", default="digits", help="digits (default), synthetic or FILE.npz")
    g.add_argument("--seed", type=int, default=d.seed, help="init and data order (0)")
    g.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate ({d.lr})")
    g.add_argument("--warmup", type=int, help="linear warmup steps (10%% of --steps)")
    g.add_argument("--clip", type=float, default=d.clip,
                   help=f"gradient-norm bound ({d.clip}; 0: off)")  # fmt: skip
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--eval-every", type=int, default=d.eval_every, metavar="K")
    g.add_argument("--cache", metavar="DIR", help="compilation cache (default: user cache; none)")
    g.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    g = train.add_argument_group("checkpoints (orbax; DIR/checkpoints/<step>)")
    g.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="save every K steps and at the end")  # fmt: skip
    g.add_argument("--keep", type=int, default=3, metavar="N", help="keep the newest N (3)")
    g.add_argument("--resume", metavar="DIR",
                   help="continue run DIR from its newest valid checkpoint (any plan)")  # fmt: skip


def model_config(
    args: argparse.Namespace, defaults: dict[str, Any] = DEFAULT_MODEL, head_zeroinit: bool = False
) -> Any:
    """The ViT from the model flags over ``defaults`` (verification draws a random head)."""
    from shardkit.run import config

    names = (*MODEL_FLAGS, "pool", "posemb", "dtype", "precision")
    overrides = {k: getattr(args, k) for k in names}
    return config.model_config(overrides, args.variant, defaults, head_zeroinit)


def with_matrix_options(cases: list[Any], args: argparse.Namespace) -> list[Any]:
    """The matrix's cases with ``--layers``, ``--kernel`` and ``--grad-sync`` (those given) in
    every plan, and ``--overlap`` in every plan that allows it: those rows are named
    "+overlap", the others say why not."""
    import dataclasses

    from shardkit.mesh import PlanError

    options = ("layers", "kernel", "grad_sync")
    given = {k: getattr(args, k) for k in options if getattr(args, k)}
    out = []
    for case in cases:
        plan, name = dataclasses.replace(case.plan, **given), case.name
        overlap = getattr(args, "overlap", False)
        if overlap:
            form = overlap if plan.sp == "megatron" else True  # both ways: Megatron-SP's rings
            try:
                plan = dataclasses.replace(plan, overlap=form)
                name = f"{name} +overlap" + (" both ways" if form == "bidirectional" else "")
            except PlanError:
                name = f"{name} ({_no_overlap(plan)})"
        out.append(dataclasses.replace(case, name=name, plan=plan))
    return out


def _no_overlap(plan: Any) -> str:
    """Why ``plan`` takes no ``--overlap`` (``Plan``'s rules, in a few words)."""
    if plan.pp != "none" or plan.recompute:
        return "no overlap: --pp, --remat"
    if plan.zero == 1:
        return "no overlap: ZeRO-1's scatter is after backward; --zero 2 overlaps"
    return "no overlap: nothing to hide"


def plan_given(args: argparse.Namespace) -> bool:
    flags = ("mesh", "sp", "ulysses", "fsdp", "zero", "remat", "pp")
    return any(getattr(args, f) for f in flags) or {args.microbatches, args.virtual} != {None}


def plan_from_args(args: argparse.Namespace) -> Any:
    from shardkit.mesh import Plan, PlanError, format_mesh, parse_mesh

    mesh = parse_mesh(args.mesh or f"data={args.devices}")
    plan = Plan(
        mesh,
        sp=args.sp or "none",
        ulysses=args.ulysses,
        fsdp=args.fsdp,
        zero=args.zero or 0,
        remat=args.remat or "none",
        layers=args.layers or "scan",
        kernel=args.kernel or "auto",
        overlap=args.overlap,
        grad_sync=args.grad_sync or "float32",
        pp=args.pp or "none",
        microbatches=1 if args.microbatches is None else args.microbatches,
        virtual=1 if args.virtual is None else args.virtual,
    )
    if plan.num_devices != args.devices:
        raise PlanError(
            f"Mesh {format_mesh(mesh)} uses {plan.num_devices} devices but --devices is "
            f"{args.devices}."
        )
    return plan


def _check(cfg: Any, plan: Any, batch: int) -> None:
    """PlanError unless ``plan`` runs ``cfg``; then the ZeRO note (``_note``)."""
    from shardkit.run import config

    config.check(cfg, plan, batch)
    _note(cfg, plan)


def _note(cfg: Any, plan: Any) -> None:
    """One stderr line naming the leaves ZeRO keeps whole, if any (not an error: the right
    call)."""
    from shardkit.run import config

    message = config.zero_note(cfg, plan)
    if message:
        print(f"shardkit: note: {message}", file=sys.stderr)


def _mesh_devices(spec: str | None) -> int:
    """The devices a ``--mesh`` uses (8 without one): ``--devices``' default."""
    import math

    from shardkit.mesh import parse_mesh

    return math.prod(parse_mesh(spec).values()) if spec else 8


def setup_devices(n: int) -> None:
    """``n`` CPU devices in all, here or over the processes of a launch (``run.launch``)."""
    from shardkit.run.launch import join_devices

    if n < 1:
        raise UsageError(f"--devices must be positive, got {n}.")
    join_devices(n)


def run_verify(args: argparse.Namespace) -> int:
    from shardkit.run import verify

    setup_devices(args.devices)
    cfg = model_config(args)
    if plan_given(args):
        cases = [verify.Case("custom", plan_from_args(args))]
    else:
        cases = with_matrix_options(verify.default_matrix(args.devices), args)
    models = verify.prepare(cfg, cases, args.batch)  # every plan checked before anything runs
    if plan_given(args):
        _note(cfg, cases[0].plan)
    ok = verify.run_cases(cfg, cases, args.batch, as_json=args.json, echo=print, models=models)
    return 0 if ok else 1


def run_inspect(args: argparse.Namespace) -> int:
    if args.target:
        from shardkit.run import target

        target.prepare_environment()  # before JAX starts: the CPU backend, libtpu shareable
    elif args.tpu_flags:
        raise UsageError("--tpu-flags sets the TPU compiler's flags: it needs --target.")
    from shardkit.run import inspect

    setup_devices(args.devices)
    check_plot(args)
    from shardkit.run import config

    cfg = model_config(args)
    plan = plan_from_args(args)
    devices = target.topology_devices(args.target, plan.num_devices) if args.target else None
    model = config.build(cfg, plan, args.batch, devices)
    _note(cfg, model.plan)
    flags = target.TPU_FLAGS[args.tpu_flags or "default"] if args.target else None
    print(inspect.run(model, args.batch, as_json=args.json, hlo_path=args.hlo,
                      plot_path=args.plot, target=args.target, compiler_options=flags))  # fmt: skip
    return 0


def train_config(args: argparse.Namespace, ds: Any) -> Any:
    """The train model: image size, channels and classes from the data unless given (checked)."""
    from shardkit.run import datasets

    data = {"image": ds.image_size, "channels": ds.channels, "classes": ds.classes}
    for name in ("image", "channels"):
        given = getattr(args, name)
        if given is not None and given != data[name]:
            raise UsageError(
                f"--{name} {given} does not match the data ({args.data}: {name} {data[name]})."
            )
    if args.variant:
        data = {k: v for k, v in data.items() if getattr(args, k) is None}
        args = argparse.Namespace(**{**vars(args), **data})
        cfg = model_config(args, head_zeroinit=True)
    else:
        cfg = model_config(args, {**TRAIN_MODEL, **data}, head_zeroinit=True)
    datasets.check_labels(ds, cfg.classes, f"--data {args.data}")
    return cfg


def _require_train_extras(data: str) -> None:
    needed = {"matplotlib": "DIR/curves.png"}
    if data == "digits":
        needed["sklearn"] = "the digits"
    for module, why in needed.items():
        if importlib.util.find_spec(module) is None:
            raise UsageError(f"train needs {module} for {why}: pip install 'shardkit[train]'.")


def _train_setup(args: argparse.Namespace) -> tuple[Any, ...]:
    """(opts, cfg, plan, dataset, out): every check a user can fail, before anything compiles
    or is written."""
    import pathlib

    from shardkit.run import datasets, train

    opts = train.TrainOptions(
        steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup,
        clip=args.clip or float("inf"), weight_decay=args.weight_decay,
        eval_every=args.eval_every, seed=args.seed,
    )  # fmt: skip
    _require_train_extras(args.data)
    setup_devices(args.devices)
    ds = datasets.load(args.data)
    cfg = train_config(args, ds)
    plan = plan_from_args(args)
    _check(cfg, plan, args.batch)
    datasets.Loader(ds.train_images, ds.train_labels, args.batch, args.seed)  # batch fits data
    if args.resume:
        if not pathlib.Path(args.resume).is_dir():
            raise UsageError(f"--resume {args.resume}: no such run directory.")
        args.out = args.out or args.resume
    out = pathlib.Path(args.out) if args.out else train.default_out_dir()
    if args.checkpoint_every is not None and (args.checkpoint_every < 1 or args.keep < 1):
        raise UsageError("--checkpoint-every and --keep must be positive.")
    return opts, cfg, plan, ds, out


def run_train(args: argparse.Namespace) -> int:
    import pathlib

    from shardkit.run import train

    cache = None if args.cache == "none" else args.cache or train.default_cache_dir()
    train.enable_cache(cache)  # before anything compiles
    opts, cfg, plan, ds, out = _train_setup(args)
    import jax

    resume = pathlib.Path(args.resume) if args.resume else None
    continuing = resume is not None and out.resolve() == resume.resolve()
    if jax.process_index() == 0 and not continuing:  # the one process that writes files
        train.prepare_out_dir(out, args.force)
    extra = {"command": ["shardkit", *args.argv], "cache": cache}
    checkpoints = None
    if args.checkpoint_every is not None:
        checkpoints = train.CheckpointOptions(args.checkpoint_every, args.keep)
    try:
        last = train.train(cfg, plan, ds, opts, out, extra_config=extra,
                           checkpoints=checkpoints, resume=resume)  # fmt: skip
    except train.TrainingDivergedError as err:
        print(f"shardkit: {err}", file=sys.stderr)
        return 1
    print(
        f"step {last['step']}: loss {last['loss']:.4f}, test_loss {last['test_loss']:.4f}, "
        f"test_accuracy {last['test_accuracy']:.4f}; wrote {out}/"
        "{metrics.jsonl,config.json,curves.png}"
    )
    return 0


def check_plot(args: argparse.Namespace) -> None:
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'shardkit[plot]'.")


def run_launch(args: argparse.Namespace) -> int:
    """Checks the subcommand here (its flags, its device count), then runs it as P processes."""
    from shardkit.run import launch

    sub = args.subcommand[1:] if args.subcommand[:1] == ["--"] else args.subcommand
    if not sub:
        raise UsageError("launch needs a subcommand after --, e.g. -- verify --mesh data=8.")
    if sub[0] not in LAUNCHABLE:
        raise UsageError(f"launch runs {', '.join(LAUNCHABLE)}; not {sub[0]!r}.")
    for name in ("procs", "devices_per_proc"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be positive.")
    inner = build_parser().parse_args(sub)
    devices = inner.devices or _mesh_devices(inner.mesh)
    if devices != args.procs * args.devices_per_proc:
        raise UsageError(
            f"--procs {args.procs} × --devices-per-proc {args.devices_per_proc} = "
            f"{args.procs * args.devices_per_proc} devices, but {sub[0]} uses {devices}."
        )
    return launch.launch(
        sub, args.procs, port=args.port, timeout_s=args.timeout, log_dir=args.log_dir,
        heartbeat_s=args.heartbeat, watchdog_s=args.watchdog,
    )  # fmt: skip


VIT_ONLY = (*MODEL_FLAGS, "variant", "pool", "posemb", "dtype", "precision", "ulysses", "zero",
            "layers", "overlap", "grad_sync", "hlo", "plot", "target", "tpu_flags",
            "resume", "checkpoint_every", "keep", "eval_every", "cache", "data", "chip",
            "batches", "remats", "attention", "tokens", "ring")  # fmt: skip
LM_ONLY = ("--experts", "--top-k", "--capacity-factor", "--documents", "--tied")
LM_DIMS = {"dim": "dim", "depth": "layers", "heads": "heads", "mlp_dim": "mlp"}  # flag: field


def run_lm(args: argparse.Namespace) -> int:
    """``verify``, ``inspect``, ``train`` or ``bench`` of ``--model gpt`` / ``moe-gpt``
    (``run.lm``, ``run.lm_bench``)."""
    if getattr(args, "attention", False):
        raise UsageError("--attention times attention alone, with no model: give no --model.")
    kept = (*LM_DIMS, "plot") if args.command == "bench" else tuple(LM_DIMS)
    flags = ["--" + n.replace("_", "-") for n in VIT_ONLY if n not in kept]
    given = [f for f in flags if any(a == f or a.startswith(f + "=") for a in args.argv)]
    if given:
        raise UsageError(f"{given[0]} applies to the ViT only, not to --model {args.model}.")
    moe_flags = [f for f in LM_ONLY[:3] if f in args.argv]
    if args.model == "gpt" and moe_flags:
        raise UsageError(f"{moe_flags[0]} needs --model moe-gpt (the gpt is dense).")
    from shardkit.run import lm

    setup_devices(args.devices)
    cfg = lm.config(args.model, args.experts, args.top_k, args.capacity_factor, args.documents,
                    args.tied)  # fmt: skip
    args.lm_dims = {field: getattr(args, flag) for flag, field in LM_DIMS.items()
                    if getattr(args, flag) is not None}  # fmt: skip
    cfg = dataclasses.replace(cfg, **args.lm_dims)
    batch = args.batch or LM_BATCH * (2 if args.command != "train" else 1)
    given_plan = args.mesh or args.sp or args.fsdp or args.remat or args.pp
    given_plan = given_plan or args.microbatches is not None or args.virtual is not None
    kernel, mesh = args.kernel or "auto", args.mesh or f"data={args.devices}"
    micro, virtual = (1 if n is None else n for n in (args.microbatches, args.virtual))
    pp = (args.pp or "none", micro, virtual)
    plan = lm.plan(mesh, args.sp, args.fsdp, args.remat or "none", kernel, pp)
    if args.command == "verify":
        plans = {"custom": plan} if given_plan else lm.default_plans(cfg, kernel)
        return 0 if lm.verify(cfg, plans, batch, as_json=args.json) else 1
    if args.command == "inspect":
        print(lm.inspect(cfg, plan, batch, as_json=args.json))
        return 0
    if args.command == "bench":
        from shardkit.cli import bench

        return bench.run_lm_bench(args, cfg, batch, plan if given_plan else None)
    return lm.train_command(cfg, plan, batch, steps=args.steps, lr=args.lr, seed=args.seed,
                            out=args.out, force=args.force, warmup=args.warmup,
                            clip=args.clip or float("inf"),
                            weight_decay=args.weight_decay)  # fmt: skip


def _run_bench(args: argparse.Namespace) -> int:
    from shardkit.cli import bench

    return bench.run_bench(args)


def _run_plan(args: argparse.Namespace) -> int:
    from shardkit.cli import plan

    return plan.run_plan(args)


def main(argv: Sequence[str] | None = None) -> int:
    commands = {
        "verify": run_verify,
        "inspect": run_inspect,
        "train": run_train,
        "bench": _run_bench,
        "plan": _run_plan,
        "launch": run_launch,
    }
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        args = build_parser().parse_args(argv)
        args.argv = argv
        if hasattr(args, "devices") and args.devices is None:
            args.devices = _mesh_devices(args.mesh)
        if getattr(args, "model", "vit") != "vit":
            if args.command == "plan":
                raise UsageError(
                    "plan ranks the ViT's plans; --model gpt and moe-gpt have none yet."
                )
            return run_lm(args)
        given = [f for f in LM_ONLY if f in argv]
        if given:
            raise UsageError(f"{given[0]} applies to --model gpt or moe-gpt, not to the ViT.")
        if hasattr(args, "batch") and args.batch is None:
            args.batch = args.vit_batch
        return commands[args.command](args)
    except (UsageError, ValueError) as err:  # PlanError, DataError, config errors: ValueErrors
        print(f"shardkit: error: {err}", file=sys.stderr)
        return 2
