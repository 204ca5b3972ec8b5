"""The ``shardkit`` command: ``verify`` (sharded == reference) and ``inspect`` (the ledger).

Bad arguments print one line on stderr and exit 2; a failed verification exits 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

DEFAULT_MODEL = dict(
    image=32, patch=4, channels=3, classes=10, dim=64, depth=2, heads=8, mlp_dim=128, pool="tok"
)
MODEL_FLAGS = ("image", "patch", "channels", "classes", "dim", "depth", "heads", "mlp_dim")


class UsageError(Exception):
    """A user mistake in the command line: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _add_model_opts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (default: a 2-layer ViT, dim 64, 8 heads, 32px, patch 4)")
    g.add_argument("--variant", help="mu, Ti/16, S/16, B/16 or L/16 (other flags override it)")
    for name in MODEL_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), type=int, dest=name)
    g.add_argument("--pool", choices=("tok", "gap"))
    g.add_argument("--posemb", choices=("learn", "sincos2d"))
    g.add_argument("--dtype", choices=("float32", "bfloat16"))
    g.add_argument("--batch", type=int, default=16, help="global batch (default 16)")


def _add_plan_opts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan (verify: none given runs the default matrix)")
    g.add_argument("--devices", type=int, default=8, help="CPU devices (default 8)")
    g.add_argument("--mesh", help="e.g. data=2,seq=2,model=2 (omitted axes are 1)")
    g.add_argument("--sp", choices=("none", "megatron", "ring", "ulysses", "usp"))
    g.add_argument("--ulysses", type=int, help="Ulysses factor of the seq axis for --sp usp")
    g.add_argument("--fsdp", action="store_true", help="split params over data (ZeRO-3)")
    g.add_argument("--remat", action="store_true", help="recompute blocks (re-gather under FSDP)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    verify = sub.add_parser("verify", help="check sharded == vit_ref (logits, grads, one step)")
    _add_model_opts(verify)
    _add_plan_opts(verify)
    verify.add_argument("--json", action="store_true", help="print one JSON object")
    inspect = sub.add_parser("inspect", help="collectives of the compiled train step vs the model")
    _add_model_opts(inspect)
    _add_plan_opts(inspect)
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.add_argument("--hlo", metavar="FILE", help="write the compiled HLO text here")
    inspect.add_argument("--plot", metavar="FILE.png", help="draw the collective pattern here")
    return parser


def model_config(args: argparse.Namespace) -> Any:
    import vit_ref

    overrides = {k: getattr(args, k) for k in (*MODEL_FLAGS, "pool", "posemb", "dtype")}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.variant:
        return vit_ref.variant(args.variant, head_zeroinit=False, **overrides)
    return vit_ref.ViTConfig(**{**DEFAULT_MODEL, "head_zeroinit": False, **overrides})


def _plan_given(args: argparse.Namespace) -> bool:
    return any([args.mesh, args.sp, args.ulysses, args.fsdp, args.remat])


def plan_from_args(args: argparse.Namespace) -> Any:
    from shardkit.mesh import Plan, PlanError, format_mesh, parse_mesh

    mesh = parse_mesh(args.mesh or f"data={args.devices}")
    plan = Plan(mesh, sp=args.sp or "none", ulysses=args.ulysses, fsdp=args.fsdp, remat=args.remat)
    if plan.num_devices != args.devices:
        raise PlanError(
            f"Mesh {format_mesh(mesh)} uses {plan.num_devices} devices but --devices is "
            f"{args.devices}."
        )
    return plan


def _setup_devices(n: int) -> None:
    from shardkit.mesh import set_cpu_devices

    if n < 1:
        raise UsageError(f"--devices must be positive, got {n}.")
    set_cpu_devices(n)


def run_verify(args: argparse.Namespace) -> int:
    from shardkit.run import verify

    _setup_devices(args.devices)
    cfg = model_config(args)
    if _plan_given(args):
        cases = [verify.Case("custom", plan_from_args(args))]
    else:
        cases = verify.default_matrix(args.devices)
    for case in cases:  # every plan is checked before anything compiles
        verify.check_plan(cfg, case.plan, args.batch)
    if not args.json:
        print(verify.format_header(), flush=True)
    results = []
    for case in cases:
        results.append(verify.run_case(cfg, case, args.batch))
        if not args.json:
            print(verify.format_row(results[-1]), flush=True)
    ok = all(r.ok for r in results)
    if args.json:
        print(json.dumps({"ok": ok, "cases": [r.to_json() for r in results]}))
    else:
        print(
            f"{sum(r.ok for r in results)}/{len(results)} cases match vit_ref "
            f"({cfg.dtype}, batch {args.batch})."
        )
    return 0 if ok else 1


def run_inspect(args: argparse.Namespace) -> int:
    from shardkit.comm import report

    _setup_devices(args.devices)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'shardkit[plot]'.")
    cfg = model_config(args)
    result = report.inspect(cfg, plan_from_args(args), args.batch, hlo_path=args.hlo)
    if args.plot:
        from shardkit.comm.plot import plot_report

        plot_report(result, args.plot)
    print(json.dumps(result.to_json()) if args.json else result.format())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return {"verify": run_verify, "inspect": run_inspect}[args.command](args)
    except (UsageError, ValueError) as err:  # PlanError and config errors are ValueErrors
        print(f"shardkit: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
