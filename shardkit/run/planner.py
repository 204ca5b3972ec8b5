"""``shardkit plan --target TOPOLOGY``: which plan to rent a TPU slice for, decided on a CPU.

Three steps, each a function here:

1. ``candidates``: every plan of the ViT over the slice's chips that ``check_plan`` accepts,
   from the families data × stage × seq × model: DP with ZeRO 0, 1 or 3 (FSDP) over data; TP
   or Megatron-SP over model (model ≤ 16, dividing the heads); a ring or Ulysses over seq
   (seq ≤ 16); 1F1B over stage (stage ≤ 8, dividing the depth; M = 2·stage microbatches, or
   the largest divisor of the local batch from stage up). Plans whose parameters and AdamW
   state alone overflow the chip's HBM are dropped before anything compiles.
2. ``analytic``: every candidate estimated without compiling: the step's matmul FLOPs counted
   on paper (``bench.model_flops``) over the chips, the contract's bytes (``cost.expected``).
3. ``rank``: the best candidates by that estimate compiled for the slice by the TPU compiler
   (``run.target``), until ``keep`` of them fit the chip's HBM (a plan out of HBM is compiled
   again with the block recomputed: remat "dots", then "full"); each compiled plan is
   estimated again from what the compiler made: its matmul FLOPs (loops by their trip
   counts), its bytes per collective, which of them a matmul hides, and its memory. What a
   compile found is cached on disk (``Cache``), keyed by everything that shapes the program.

The estimate (``Estimate.step_s``) is compute + exposed communication:

- compute: the busiest chip's matmul FLOPs at the train-step throughput one chip of that kind
  reaches on a step of that size (``Chip.step_flops``: measured on a v5e, 71 to 123 TFLOP/s
  from ViT-B/16 to H/14 steps, layers as a scan; other kinds scaled by their peak, marked
  assumed), divided by 1 − the pipeline's bubble (``Schedule.bubble``);
- communication: each collective's bytes sent per chip over one bidirectional ICI ring (two
  links, one each way, ``Chip.link_bytes`` each), collectives one after another; a collective
  with a matmul scheduled between its start and done counts as hidden (0 s).

It ignores: where a mesh axis lies on the torus (wraparound, several physical dimensions,
links two axes share), per-hop latency of small messages, elementwise and memory-bound time
beyond what the measured throughput holds, and whether a hidden collective outlasts the matmul
that hides it. It ranks plans; it does not predict a wall clock to the percent.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import vit_ref
from shardkit.comm.ledger import Ledger
from shardkit.mesh import Plan, PlanError
from shardkit.run import target as tgt

ADAMW_STATE = 2  # AdamW's moments, float32 like the params


# One v5e's train-step throughput, measured with the ``device`` tool
# (docs/measure/tpu_planner_check.sh; results/planner_*.json): (matmul FLOPs per step, as
# ``Ledger.flops`` counts them, recompute included; seconds per step) of shardkit's ViT, bf16,
# layers as a scan: B/16 batch 32; H/14 batch 8 (remat dots, full); L/16 batch 32 (dots); H/14
# batch 32 (full). Bigger steps keep the MXU busier: 71 to 123 TFLOP/s.
V5E_SCAN_STEPS = ((3.347e12, 0.04688), (8.081e12, 0.09538), (9.799e12, 0.09983),
                  (11.868e12, 0.13096), (39.195e12, 0.31739))  # fmt: skip
# The same B/16 step with its layers unrolled: 35.27 ms, 1.33x the scan's throughput.
UNROLLED_GAIN = 0.04688 / 0.03527
V5E_PEAK = 197e12


@dataclasses.dataclass(frozen=True)
class Chip:
    """What the estimate takes from a chip kind."""

    peak_flops: float  # vendor bf16 FLOP/s
    link_bytes: float  # ICI bytes/s, one direction, per link
    measured: bool  # its step throughput was measured (else the v5e's, scaled by peak)

    def step_flops(self, flops: float, layers: str = "scan") -> float:
        """Matmul FLOP/s one chip reaches on a ViT train step of ``flops`` per chip with its
        layers as ``layers``: the v5e's measured steps (``V5E_SCAN_STEPS``) interpolated in log
        FLOPs and clamped at their ends, unrolled layers ``UNROLLED_GAIN`` faster, another
        kind's scaled by its peak."""
        points = sorted((math.log(f), f / s) for f, s in V5E_SCAN_STEPS)
        x = math.log(max(flops, 1.0))
        rate = points[0][1] if x <= points[0][0] else points[-1][1]
        for (x0, r0), (x1, r1) in itertools.pairwise(points):
            if x0 <= x <= x1:
                rate = r0 + (r1 - r0) * (x - x0) / (x1 - x0)
        gain = UNROLLED_GAIN if layers != "scan" else 1.0
        return rate * gain * self.peak_flops / V5E_PEAK

    @property
    def source(self) -> str:
        how = "measured on one v5e" if self.measured else "the v5e's, scaled by peak: assumed"
        return f"ViT train steps {how}; docs/measure/tpu_planner_check.sh"


# ICI per link and direction, from "How to Scale Your Model" (jax-ml.github.io/scaling-book).
CHIPS = {
    "TPU v5 lite": Chip(V5E_PEAK, 4.5e10, True),
    "TPU v5e": Chip(V5E_PEAK, 4.5e10, True),
    "TPU v4": Chip(275e12, 4.5e10, False),
    "TPU v5": Chip(459e12, 9e10, False),
    "TPU v5p": Chip(459e12, 9e10, False),
    "TPU v6 lite": Chip(918e12, 9e10, False),
}


def chip_of(device_kind: str) -> Chip:
    if device_kind not in CHIPS:
        raise tgt.TargetError(
            f"The planner has no throughput and ICI figures for {device_kind!r}; "
            f"it knows {', '.join(sorted(CHIPS))}."
        )
    return CHIPS[device_kind]


def label(plan: Plan) -> str:
    """A plan in one short line: "data=4,model=2 megatron fsdp 1f1b×8"."""
    words = [",".join(f"{a}={n}" for a, n in plan.mesh.items() if n > 1) or "data=1"]
    if plan.sp != "none":
        words.append(plan.sp)
    words += ["fsdp"] if plan.fsdp else ([f"zero{plan.zero}"] if plan.zero else [])
    if plan.pp != "none":
        words.append(f"{plan.pp}×{plan.microbatches}")
    if plan.remat != "none":
        words.append(f"remat={plan.remat}")
    if plan.grad_sync != "float32":
        words.append(f"grads={plan.grad_sync}")
    return " ".join(words)


# -- 1. candidates ------------------------------------------------------------------------


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def _meshes(chips: int, cfg: vit_ref.ViTConfig) -> Iterator[dict[str, int]]:
    for stage in _divisors(chips, 8):
        for model in _divisors(chips // stage, 16):
            for seq in _divisors(chips // (stage * model), 16):
                if cfg.depth % stage or cfg.heads % model:
                    continue
                data = chips // (stage * model * seq)
                yield {"data": data, "stage": stage, "seq": seq, "model": model}


def _microbatches(stages: int, local_batch: int) -> int | None:
    """2·stages if it divides the local batch, else its largest divisor ≥ stages."""
    fits = [m for m in range(stages, 2 * stages + 1) if local_batch % m == 0]
    return fits[-1] if fits else None


def _plans(mesh: dict[str, int], batch: int, base: Plan) -> Iterator[Plan]:
    seq, model, stage, data = mesh["seq"], mesh["model"], mesh["stage"], mesh["data"]
    sps = ["ring", "ulysses"] if seq > 1 else (["none", "megatron"] if model > 1 else ["none"])
    pp: dict[str, Any] = {}
    if stage > 1:
        micro = _microbatches(stage, batch // data) if batch % data == 0 else None
        if micro is None:
            return
        pp = {"pp": "1f1b", "microbatches": micro}
    for sp in sps:
        for zero in (0, 1, 3) if data > 1 else (0,):
            try:
                yield dataclasses.replace(base, mesh=mesh, sp=sp, zero=zero, fsdp=zero == 3, **pp)
            except PlanError:
                continue


def candidates(cfg: vit_ref.ViTConfig, chips: int, batch: int, base: Plan) -> list[Plan]:
    """Every plan of the families in the module docstring that runs ``cfg`` at ``batch`` on
    ``chips`` devices (``check_plan``), with ``base``'s remat, layers, kernel, grad sync."""
    from shardkit.run import config

    out = []
    for mesh in _meshes(chips, cfg):
        for plan in _plans(mesh, batch, base):
            try:
                config.check(cfg, plan, batch)
            except PlanError:
                continue
            out.append(plan)
    return out


def state_bytes(cfg: vit_ref.ViTConfig, plan: Plan) -> float:
    """Per chip: float32 params and AdamW moments (split over model and stage; over data too
    as ZeRO splits them). A lower bound on the arguments, used to drop plans that cannot fit."""
    params = _param_count(cfg) * 4 / (plan.size("model") * plan.size("stage"))
    data = plan.size("data")
    held = params / (data if plan.zero == 3 else 1)
    return held + ADAMW_STATE * params / (data if plan.zero >= 1 else 1)


@functools.cache
def _param_count(cfg: vit_ref.ViTConfig) -> int:
    import jax

    shapes = jax.eval_shape(lambda: vit_ref.init(jax.random.key(0), cfg))
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))


# -- 2. and 3. estimates ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One plan's estimated step on the slice."""

    plan: Plan
    compute_s: float
    comm_s: float  # exposed: not hidden under a matmul
    hidden_s: float
    bubble: float
    bytes_sent: float  # per chip per step (a pipeline: the busiest stage's chip)
    compiled: bool = False
    fit: tgt.Fit | None = None
    contract_ok: bool | None = None
    compile_s: float | None = None
    error: str | None = None  # the compiler's refusal, one sentence

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def fits(self) -> bool | None:
        if self.error is not None:
            return False
        return None if self.fit is None else self.fit.fits

    def to_json(self, batch: int) -> dict[str, Any]:
        return {
            "plan": label(self.plan),
            **{k: getattr(self, k) for k in ("compute_s", "comm_s", "hidden_s", "bubble")},
            "step_s": self.step_s,
            "images_per_s": batch / self.step_s,
            "bytes_sent": self.bytes_sent,
            "compiled": self.compiled,
            "fits": self.fits,
            "peak_bytes": self.fit.peak_bytes if self.fit else None,
            "contract_ok": self.contract_ok,
            "compile_s": self.compile_s,
            "error": self.error,
        }


def _bubble(cfg: vit_ref.ViTConfig, plan: Plan) -> float:
    from shardkit.models.vit.plan import schedule

    return 0.0 if plan.pp == "none" else schedule(cfg, plan).bubble()


def analytic(cfg: vit_ref.ViTConfig, plan: Plan, batch: int, chip: Chip) -> Estimate:
    """The estimate from the paper FLOPs and the contract, before compiling (nothing hidden)."""
    from shardkit.models.vit import cost
    from shardkit.run.bench import model_flops

    bubble = _bubble(cfg, plan)
    flops = model_flops(cfg, batch) / plan.num_devices
    stages = range(plan.size("stage")) if plan.pp != "none" else [None]
    sent = max(
        cost.expected(cfg, plan, batch, platform="tpu", stage=s).total_bytes_sent() for s in stages
    )
    return Estimate(
        plan, flops / chip.step_flops(flops, plan.layers) / (1 - bubble),
        sent / (2 * chip.link_bytes), 0.0, bubble,
        sent,
    )  # fmt: skip


def facts(model: Any, batch: int, flags: str = "default") -> dict[str, Any]:
    """What a compile of ``model``'s step for its (TPU) devices tells the estimate, as JSON:
    the busiest chip's matmul FLOPs, its bytes on the wire (hidden ones apart), the contract,
    the fit to HBM, the compile time; or the compiler's refusal. ``flags``: libtpu's options
    for the compile (``run.target.TPU_FLAGS``)."""
    from shardkit.models.vit import report

    kind = str(model.mesh.devices.flat[0].device_kind)
    start = time.perf_counter()
    try:
        with tgt.uncached():
            options = tgt.TPU_FLAGS[flags]
            result = report.model_inspect(model, batch, platform="tpu", compiler_options=options)
    except Exception as err:  # the compiler's refusal (HBM, or anything else): one sentence
        return refused(err, start)
    busiest = max([result, *(r for _, r in result.others)], key=lambda r: r.measured_bytes_sent)
    wire = busiest.ledger.total_bytes_sent() - busiest.narrowed.bytes_saved  # what is sent
    flops = result.to_json()["flops"]
    return ledger_facts(busiest.ledger, wire, kind, result.contract_ok, start,
                        flops=flops, whole=result.ledger)  # fmt: skip


def refused(err: Exception, start: float) -> dict[str, Any]:
    """The facts of a step the compiler refused: its first line (HBM, or anything else)."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return {"error": first[:300], "compile_s": time.perf_counter() - start}


def ledger_facts(
    ledger: Ledger,
    wire: float,
    kind: str,
    contract_ok: bool | None,
    start: float,
    *,
    flops: float | None = None,
    whole: Ledger | None = None,
) -> dict[str, Any]:
    """``facts`` from a compiled ledger: ``wire`` its bytes as sent (after the compiler's
    narrowing), ``flops`` the busiest chip's (default the ledger's), ``whole`` the program whose
    memory counts (default the ledger's; a pipeline's stage ledgers are parts of it)."""
    whole = whole or ledger
    total = ledger.total_bytes_sent()
    hidden = sum(c.total_bytes_sent for c in ledger.collectives if c.overlapped)
    fit = tgt.fit_of(whole.memory, whole.hlo, kind) if whole.memory else None
    return {
        "flops": ledger.flops if flops is None else flops,
        "bytes_sent": wire,
        "hidden_bytes": hidden * (wire / total if total else 1.0),
        "contract_ok": contract_ok,
        "fit": dataclasses.asdict(fit) if fit else None,
        "compile_s": time.perf_counter() - start,
        "error": None,
    }


def _fit(stored: dict[str, Any] | None) -> tgt.Fit | None:
    if stored is None:
        return None
    return tgt.Fit(**{**stored, "largest": tuple(tuple(pair) for pair in stored["largest"])})


def from_facts(cfg: vit_ref.ViTConfig, plan: Plan, found: dict[str, Any], chip: Chip) -> Estimate:
    """The estimate of a compiled plan from its ``facts``."""
    bubble = _bubble(cfg, plan)
    if found["error"] is not None:
        return Estimate(plan, math.inf, math.inf, 0.0, bubble, math.nan, compiled=True,
                        error=found["error"], compile_s=found["compile_s"])  # fmt: skip
    fit = _fit(found["fit"])
    ring = 2 * chip.link_bytes
    exposed = found["bytes_sent"] - found["hidden_bytes"]
    return Estimate(
        plan,
        found["flops"] / chip.step_flops(found["flops"], plan.layers) / (1 - bubble),
        exposed / ring,
        found["hidden_bytes"] / ring,
        bubble,
        found["bytes_sent"],
        compiled=True,
        fit=fit,
        contract_ok=found["contract_ok"],
        compile_s=found["compile_s"],
    )


class Cache:
    """``facts`` per compiled plan, one JSON file each under ``root``, keyed by the topology,
    the model, the plan, the batch, the JAX and libtpu versions and shardkit's code."""

    def __init__(self, root: str | pathlib.Path | None) -> None:
        self.root = None if root is None else pathlib.Path(root)

    def _path(self, key: dict[str, Any]) -> pathlib.Path | None:
        if self.root is None:
            return None
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
        return self.root / f"{digest[:24]}.json"

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        path = self._path(key)
        if path is None or not path.exists():
            return None
        try:
            return json.loads(path.read_text())["facts"]
        except (ValueError, KeyError):  # a damaged entry is compiled again
            return None

    def put(self, key: dict[str, Any], found: dict[str, Any]) -> None:
        path = self._path(key)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"key": key, "facts": found}, default=str))


@functools.cache
def code_digest() -> str:
    """A digest of shardkit's and vit_ref's sources: a compiled plan's facts hold for this code
    only (the cache is keyed by it, so a change of the code compiles again)."""
    import shardkit

    digest = hashlib.sha256()
    for package in (pathlib.Path(shardkit.__file__).parent, pathlib.Path(vit_ref.__file__).parent):
        for path in sorted(package.rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_key(
    topology: str, cfg: vit_ref.ViTConfig, plan: Plan, batch: int, flags: str
) -> dict[str, Any]:
    import importlib.metadata
    import os

    import jax

    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = "none"
    libtpu += " " + os.environ.get("LIBTPU_INIT_ARGS", "")  # the compiler's flags
    return {"topology": topology, "model": dataclasses.asdict(cfg),
            "plan": dataclasses.asdict(plan), "batch": batch, "jax": jax.__version__,
            "libtpu": libtpu, "flags": flags, "code": code_digest()}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Ranking:
    """The planner's answer: compiled plans first (fitting ones by estimated step time), then
    the plans only estimated on paper."""

    topology: str
    device_kind: str
    chip: Chip
    batch: int
    compiled: tuple[Estimate, ...]
    analytic: tuple[Estimate, ...]  # the candidates not compiled, best first
    dropped: int  # candidates whose params and optimizer state alone overflow HBM

    def best(self) -> Estimate | None:
        fitting = [e for e in self.compiled if e.fits]
        return fitting[0] if fitting else None


REMAT_LADDER = ("none", "dots", "full")  # tried in turn on a plan that runs out of HBM


def rank(
    cfg: vit_ref.ViTConfig,
    topology: str,
    batch: int,
    base: Plan,
    *,
    keep: int = 4,
    remats: tuple[str, ...] = REMAT_LADDER,
    cache: Cache | None = None,
    flags: str = "default",
    echo: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> Ranking:
    """Enumerates, estimates on paper, compiles the best until ``keep`` fit (at most 4·keep
    compiles; ``keep=0``: none), and ranks. A plan the compiler finds out of HBM is compiled
    again under the next policy of ``remats`` before the next plan. ``flags``: libtpu's
    options for every compile (``run.target.TPU_FLAGS``). ``echo`` gets one progress line per
    compile."""
    devices = tgt.topology_devices(topology)
    kind = str(devices.flat[0].device_kind)
    chip, hbm = chip_of(kind), tgt.HBM_BYTES.get(kind, math.inf)
    plans = candidates(cfg, devices.size, batch, dataclasses.replace(base, remat=remats[0]))
    if not plans:
        raise PlanError(f"No plan of the planner's families runs this ViT at batch {batch} on "
                        f"{devices.size} chips (the batch must split over data).")  # fmt: skip
    room = [p for p in plans if state_bytes(cfg, p) <= hbm]
    paper = sorted((analytic(cfg, p, batch, chip) for p in room),
                   key=lambda e: (e.step_s, state_bytes(cfg, e.plan)))  # fmt: skip
    where = (cfg, topology, batch, devices, flags)
    compile_one = _compiler(where, chip, cache or Cache(None), echo)
    done: list[Estimate] = []
    used = 0
    for estimate in paper:
        if sum(bool(e.fits) for e in done) >= keep or len(done) >= 4 * keep:
            break
        used += 1
        for policy in remats:
            done.append(compile_one(dataclasses.replace(estimate.plan, remat=policy)))
            if not _out_of_memory(done[-1]) or len(done) >= 4 * keep:
                break
    compiled = sorted(done, key=lambda e: (not e.fits, e.step_s))
    return Ranking(topology, kind, chip, batch, tuple(compiled), tuple(paper[used:]),
                   len(plans) - len(room))  # fmt: skip


def _out_of_memory(e: Estimate) -> bool:
    return e.fits is False and (e.error is None or "RESOURCE_EXHAUSTED" in e.error)


def _compiler(
    where: tuple[Any, ...], chip: Chip, cache: Cache, echo: Callable[[str], None]
) -> Callable[[Plan], Estimate]:
    """plan -> its compiled estimate, from the cache or a compile (one progress line each);
    ``where``: (model config, topology, batch, the slice's devices, libtpu flags)."""
    from shardkit.run import config

    cfg, topology, batch, devices, flags = where
    count = iter(range(1, 1 << 30))

    def compile_one(plan: Plan) -> Estimate:
        key = cache_key(topology, cfg, plan, batch, flags)
        found = cache.get(key)
        hit = found is not None
        if found is None:
            found = facts(config.build(cfg, plan, batch, devices), batch, flags)
            cache.put(key, found)
        estimate = from_facts(cfg, plan, found, chip)
        echo(f"[{next(count)}] {label(plan)}: {_verdict(estimate, hit)}")
        return estimate

    return compile_one


def _verdict(e: Estimate, cached: bool) -> str:
    if e.error is not None:
        return f"refused by the compiler ({e.error[:120]})"
    took = "cached" if cached else f"compiled in {e.compile_s:.0f} s"
    peak = f"{e.fit.peak_bytes / tgt.GIB:.2f} GiB" if e.fit else "memory unknown"
    fits = "fits" if e.fits else "does NOT fit"
    return f"{took}; {fits} ({peak}); estimated {e.step_s * 1e3:.1f} ms"


COLUMNS = ("rank", "plan", "from", "fits", "GiB", "compute ms", "comm ms", "hidden ms",
           "bubble", "step ms", "img/s", "contract")  # fmt: skip


def _row(i: int, e: Estimate, batch: int) -> list[str]:
    how = "compiled" if e.compiled else "paper"
    fits = {True: "✓", False: "✗", None: "?"}[e.fits]
    gib = f"{e.fit.peak_bytes / tgt.GIB:.2f}" if e.fit else "-"
    if e.error is not None:
        return [str(i), label(e.plan), how, fits, gib, *["-"] * 6, "refused"]
    contract = {True: "✓", False: "✗", None: "-"}[e.contract_ok]
    ms = [f"{t * 1e3:.3g}" for t in (e.compute_s, e.comm_s, e.hidden_s)]
    return [str(i), label(e.plan), how, fits, gib, *ms, f"{e.bubble:.2f}",
            f"{e.step_s * 1e3:.3g}", f"{batch / e.step_s:,.0f}", contract]  # fmt: skip


def header(r: Ranking, cfg: vit_ref.ViTConfig) -> str:
    c = r.chip
    return (
        f"{r.topology}: {r.device_kind}; ViT dim={cfg.dim} depth={cfg.depth} heads={cfg.heads} "
        f"tokens={cfg.num_tokens} {cfg.dtype}, batch {r.batch}. Compute at "
        f"{c.step_flops(V5E_SCAN_STEPS[0][0]) / 1e12:.0f}-"
        f"{c.step_flops(V5E_SCAN_STEPS[-1][0]) / 1e12:.0f} TFLOP/s per chip by step size "
        f"({c.source}), each collective over one ICI ring at {2 * c.link_bytes / 1e9:.0f} GB/s "
        "per chip."
    )


def format_table(r: Ranking, cfg: vit_ref.ViTConfig, markdown: bool = False, more: int = 5) -> str:
    """The ranking as the command prints it: the compiled plans, fitting ones by estimated step
    time, then the next ``more`` (10 when nothing was compiled) estimated on paper."""
    paper = r.analytic[: more if r.compiled else 2 * more]
    shown = [*r.compiled, *paper]
    from shardkit.run.bench import table_lines

    body = [_row(i + 1, e, r.batch) for i, e in enumerate(shown)]
    lines = [header(r, cfg), "", *table_lines(COLUMNS, body, markdown), ""]
    best = r.best()
    if best is not None:
        step = best.step_s
        lines.append(f"best: {label(best.plan)}, {step * 1e3:.1f} ms per step, "
                     f"{r.batch / step:,.0f} img/s (estimated from its compiled step)")  # fmt: skip
    elif r.compiled:
        lines.append("no compiled plan fits: try a smaller batch, --remat, or more chips")
    lines.append(f"{len(r.compiled)} compiled, {len(r.analytic)} estimated on paper only "
                 f"({len(r.analytic) - len(paper)} not shown)")  # fmt: skip
    if r.dropped:
        lines.append(f"dropped: {r.dropped} plan(s) whose params and AdamW state alone "
                     "overflow the chip's HBM")  # fmt: skip
    return "\n".join(lines)


def _best_label(r: Ranking) -> str | None:
    best = r.best()
    return None if best is None else label(best.plan)


def to_json(r: Ranking) -> dict[str, Any]:
    return {
        "topology": r.topology,
        "device_kind": r.device_kind,
        "chip": dataclasses.asdict(r.chip) | {"source": r.chip.source},
        "batch": r.batch,
        "compiled": [e.to_json(r.batch) for e in r.compiled],
        "analytic": [e.to_json(r.batch) for e in r.analytic],
        "dropped": r.dropped,
        "best": _best_label(r),
    }
