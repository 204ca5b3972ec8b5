"""CPU device setup, meshes and the parallelism plan.

Mesh axes (always these words, in this order):
  ``data``  -- the batch; FSDP/ZeRO also split params and optimizer state over it.
  ``stage`` -- pipeline stages (layers; ``parallel.pipeline``): a plan with stage > 1 names its
               schedule (``Plan.pp``).
  ``seq``   -- tokens (ring attention, Ulysses, their hybrid).
  ``model`` -- attention heads and the MLP hidden width (tensor parallelism, Megatron-SP).

Any axis may have size 1. Meshes use ``AxisType.Auto`` so ``shard_map`` accepts arrays placed
with plain ``NamedSharding``s.

Several processes (``jax.distributed``, one controller per process, gloo collectives on CPU)
form one global mesh: ``Processes.from_env`` reads the ``SHARDKIT_*`` variables that
``shardkit launch`` sets (or a user sets by hand on each host), ``join`` starts the runtime, and
``to_host`` brings a global array back to numpy on every process.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

AXES = ("data", "stage", "expert", "seq", "model")
SP_MODES = ("none", "megatron", "ring", "ulysses", "usp")
PP_MODES = ("none", "gpipe", "1f1b", "interleaved", "zb", "zbv")
ZERO_LEVELS = (0, 1, 2, 3)  # none, optimizer state, + gradients, + params (FSDP)
# What a block keeps for its backward: everything ("none": no recompute), only the outputs of
# the matmuls without batch dims ("dots": the rest, LayerNorm, softmax, GELU and attention's
# batched products, recomputed), or only its input ("full": the whole block recomputed).
REMAT_POLICIES = ("none", "dots", "full")
LAYER_LOOPS = ("scan", "unrolled", "list")
KERNELS = ("auto", "jnp", "pallas")  # attention's compute: shardkit.kernels
GRAD_SYNC = ("float32", "bfloat16")  # the dtype gradient all-reduces travel in


class PlanError(ValueError):
    """A plan that cannot work on the given mesh, model or batch (one sentence says why)."""


def set_cpu_devices(n: int) -> None:
    """Makes the CPU backend expose ``n`` devices. Call before anything touches a JAX backend."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as err:  # the backend already exists
        have = len(jax.devices("cpu"))
        if have < n:
            raise PlanError(
                f"Cannot create {n} CPU devices: the JAX backend already started with {have}; "
                "call shardkit.set_cpu_devices before any other JAX call."
            ) from err


PROCESS_ENV = {
    "coordinator": "SHARDKIT_COORDINATOR",  # host:port of process 0's coordination service
    "count": "SHARDKIT_NUM_PROCESSES",
    "index": "SHARDKIT_PROCESS_ID",  # 0 .. count-1; process 0 hosts the coordinator
    "heartbeat_s": "SHARDKIT_HEARTBEAT_S",  # optional: a silent peer is declared dead after this
    "init_timeout_s": "SHARDKIT_INIT_TIMEOUT_S",  # optional: waiting for every process to join
}


@dataclasses.dataclass(frozen=True)
class Processes:
    """One process's place in a multi-controller run (``jax.distributed``)."""

    coordinator: str
    count: int
    index: int
    heartbeat_s: int = 10
    init_timeout_s: int = 60

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Processes | None:
        """The ``SHARDKIT_*`` variables (``PROCESS_ENV``), or None when none is set."""
        env = dict(os.environ if environ is None else environ)
        given = {field: env[name] for field, name in PROCESS_ENV.items() if env.get(name)}
        if not given:
            return None
        for field in ("coordinator", "count", "index"):
            if field not in given:
                raise PlanError(f"{PROCESS_ENV[field]} is not set; a multi-process run needs "
                                f"{', '.join(list(PROCESS_ENV.values())[:3])}.")  # fmt: skip
        values: dict[str, Any] = {"coordinator": given.pop("coordinator")}
        for field, text in given.items():
            if not text.isdigit():
                raise PlanError(f"{PROCESS_ENV[field]}={text!r} is not a non-negative integer.")
            values[field] = int(text)
        procs = cls(**values)
        if procs.count < 1 or not 0 <= procs.index < procs.count:
            raise PlanError(f"{PROCESS_ENV['index']}={procs.index} is not in [0, "
                            f"{PROCESS_ENV['count']}={procs.count}).")  # fmt: skip
        return procs

    def local_devices(self, total: int) -> int:
        """Each process's CPU devices when the mesh has ``total`` (PlanError unless it divides)."""
        if total % self.count:
            raise PlanError(f"{total} devices cannot be split evenly over {self.count} processes.")
        return total // self.count

    def join(self, total_devices: int) -> None:
        """``total_devices // count`` CPU devices here, then ``jax.distributed.initialize``:
        blocks until every process joined (``init_timeout_s``) and from then on aborts this
        process when a peer misses heartbeats for ``heartbeat_s``."""
        set_cpu_devices(self.local_devices(total_devices))
        jax.distributed.initialize(
            self.coordinator,
            num_processes=self.count,
            process_id=self.index,
            initialization_timeout=self.init_timeout_s,
            heartbeat_timeout_seconds=self.heartbeat_s,
        )


def to_host(tree: Any) -> Any:
    """Every leaf as a numpy array on every process: a leaf spread over several processes'
    devices is gathered (``process_allgather``, a collective: call it on every process)."""
    from jax.experimental import multihost_utils

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(leaf, tree)


def parse_mesh(spec: str) -> dict[str, int]:
    """Parses ``"data=2,model=4"`` into ``{"data": 2, "stage": 1, "seq": 1, "model": 4}``."""
    shape = dict.fromkeys(AXES, 1)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, size = part.partition("=")
        if not eq or not size.strip().isdigit() or int(size) < 1:
            raise PlanError(f"Mesh entry {part!r} is not of the form axis=positive_integer.")
        if name.strip() not in AXES:
            raise PlanError(f"Unknown mesh axis {name.strip()!r}; axes are {', '.join(AXES)}.")
        shape[name.strip()] = int(size)
    return shape


def platform(mesh: Mesh) -> str:
    """The platform of ``mesh``'s devices ("cpu", "tpu", ...): a TPU topology's devices under
    ``inspect --target`` too."""
    return str(mesh.devices.flat[0].platform)


def make_mesh(
    shape: dict[str, int] | None = None, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ``data × stage × expert × seq × model`` mesh (Auto axes) over the first prod(shape)
    devices.

    Args:
      shape: axis sizes, e.g. ``{"data": 2, "model": 4}``; omitted axes are 1.
      devices: the devices to use (default ``jax.devices()``); prod(shape) of them are taken.
    """
    shape = {**dict.fromkeys(AXES, 1), **(shape or {})}
    unknown = sorted(set(shape) - set(AXES))
    if unknown:
        raise PlanError(f"Unknown mesh axis {unknown[0]!r}; axes are {', '.join(AXES)}.")
    devices = list(jax.devices() if devices is None else devices)
    sizes = tuple(shape[a] for a in AXES)
    need = math.prod(sizes)
    if need > len(devices):
        hint = (
            f"; call shardkit.set_cpu_devices({need}) before any other JAX call for more CPU "
            "devices"
            if jax.default_backend() == "cpu"
            else ""
        )
        raise PlanError(
            f"Mesh {format_mesh(shape)} needs {need} devices but only {len(devices)} are "
            f"available{hint}."
        )
    grid = np.asarray(devices[:need], dtype=object).reshape(sizes)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def format_mesh(shape: dict[str, int]) -> str:
    """``"data=2,seq=1,model=4"``: every axis but ``stage`` and ``expert``, each named only
    when > 1."""
    return ",".join(
        f"{a}={shape.get(a, 1)}"
        for a in AXES
        if a not in ("stage", "expert") or shape.get(a, 1) > 1
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a model is parallelised: mesh shape and the strategy on each axis.

    Attributes:
      mesh: axis sizes ``{"data": A, "seq": B, "model": C}``.
      sp: sequence-parallel mode: none, megatron (over ``model``, and over ``seq`` too when the
        mesh has one: attention then runs a ring or Ulysses core over seq), ring, ulysses or usp
        (over ``seq``).
      ulysses: the Ulysses factor of the ``seq`` axis for ``sp="usp"`` (None: chosen
        automatically) or for ``sp="megatron"`` on a seq axis (None: a ring over seq).
      zero: the ZeRO level over ``data``: 0 none; 1 the optimizer state split (gradients
        reduce-scattered at the step's end, params all-gathered after the update); 2 also the
        gradients, reduce-scattered where backward makes them; 3 the params too (FSDP).
      fsdp: the same as ``zero=3`` (either sets the other; a conflict is a PlanError).
      remat: the block's recomputation policy (``REMAT_POLICIES``): "none", "dots" (keep the
        matmul outputs, recompute the elementwise work and attention's scores) or "full"
        (recompute the block); True means "full", False "none". Recomputing re-runs the
        collectives whose results the backward reads (with FSDP the layer's weights are
        gathered again).
      layers: how the blocks run (``LAYER_LOOPS``): "scan" (one ``lax.scan`` over the stacked
        layers: one compiled body, the loop's trip count read by the ledger), "unrolled" (a
        Python loop over the same stacked params: XLA fuses across layers; faster on a TPU,
        longer to compile) or "list" (unrolled over per-layer param buffers, each layer's
        weights their own arrays, as big_vision keeps them: each layer's optimizer update
        fuses into its gradient's matmul; the model's ``shard`` unstacks, ``to_reference``
        stacks back; not under a pipeline, whose chunks are slices of the stack).
      pp: the pipeline schedule over ``stage`` (``parallel.schedules``): none, gpipe, 1f1b,
        interleaved, zb (ZB-H1) or zbv (ZB-V, two chunks per stage: ``virtual`` becomes 2);
        needs stage > 1, and stage > 1 needs one.
      microbatches: M, micro-batches per data-local batch: the pipeline's, or without one,
        gradient accumulation (``data.accumulate``: the M micro-batches run one after
        another, their gradients summed before the step's one sync; the same bytes, one
        micro-batch's activations live). Not with FSDP, ZeRO-2 or DP's layer-by-layer sync
        (``--overlap``), whose param collectives would run M times.
      virtual: V, layer chunks per stage (``interleaved`` only).
      kernel: attention's per-device compute (``KERNELS``): "jnp", "pallas" (JAX's splash
        kernels, ``shardkit.kernels``; Pallas' interpreter off a TPU) or "auto" (Pallas on a
        TPU backend, else jnp). It moves no bytes.
      grad_sync: the dtype the gradient all-reduces travel in (``GRAD_SYNC``): "float32", or
        "bfloat16" (half the bytes on a TPU, as XLA's partitioner sends a bf16 model's
        gradients; each device's partial gradient rounded to bf16 first).
      overlap: run Megatron-SP's all-gathers and reduce-scatters as collective matmuls
        (``parallel.overlap``: ppermute rings a TPU schedules under the matmuls; the same
        bytes in n − 1 steps); FSDP's gather of each layer one layer ahead and its gradient's
        reduce-scatter one layer behind, as permutes (``parallel.data.prefetch_layers``;
        the same bytes, one more layer's weights held); ZeRO-2's per-layer gradient
        reduce-scatter likewise one layer behind (``data.zero_attach(permuted=True)``); and
        without FSDP or ZeRO, each layer's gradient all-reduce (over data and the token axes)
        in the next layer's backward step, as a reduce-scatter of permutes and an all-gather
        (``parallel.data.sync_in_backward``; the same bytes); plain TP (a model axis, sp
        "none": ``halves``) on two half-batches a region apart, each one's all-reduces as
        permutes and an all-gather beside the other's matmuls (``tensor.pipelined_regions``;
        the same bytes; an even batch per data shard). Needs sp="megatron", a model axis,
        FSDP, ZeRO-2, or a data or seq axis to sync over; not yet with remat or a pipeline.
        ``"bidirectional"``: the same, with Megatron-SP's rings running both ways, half a
        token block each way.
    """

    mesh: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(AXES, 1))
    sp: str = "none"
    ulysses: int | None = None
    fsdp: bool = False
    zero: int = 0
    remat: str = "none"
    layers: str = "scan"
    pp: str = "none"
    microbatches: int = 1
    virtual: int = 1
    kernel: str = "auto"
    overlap: bool | str = False
    grad_sync: str = "float32"

    def __post_init__(self) -> None:
        full = {**dict.fromkeys(AXES, 1), **self.mesh}
        unknown = sorted(set(full) - set(AXES))
        if unknown:
            raise PlanError(f"Unknown mesh axis {unknown[0]!r}; axes are {', '.join(AXES)}.")
        for axis, size in full.items():
            if not isinstance(size, int) or size < 1:
                raise PlanError(
                    f"Mesh axis {axis} must have a positive integer size, got {size!r}."
                )
        object.__setattr__(self, "mesh", full)
        if self.sp not in SP_MODES:
            raise PlanError(f"Unknown sp mode {self.sp!r}; choose one of {', '.join(SP_MODES)}.")
        if self.pp not in PP_MODES:
            raise PlanError(
                f"Unknown pipeline schedule {self.pp!r}; choose one of {', '.join(PP_MODES)}."
            )
        if isinstance(self.remat, bool):
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if self.remat not in REMAT_POLICIES:
            raise PlanError(
                f"Unknown remat policy {self.remat!r}; choose one of {', '.join(REMAT_POLICIES)}."
            )
        if self.layers not in LAYER_LOOPS:
            raise PlanError(
                f"Unknown layers {self.layers!r}; choose one of {', '.join(LAYER_LOOPS)}."
            )
        if self.kernel not in KERNELS:
            raise PlanError(f"Unknown kernel {self.kernel!r}; choose one of {', '.join(KERNELS)}.")
        if self.grad_sync not in GRAD_SYNC:
            raise PlanError(
                f"Unknown --grad-sync {self.grad_sync!r}; choose one of {', '.join(GRAD_SYNC)}."
            )
        if self.zero not in ZERO_LEVELS:
            raise PlanError(f"--zero must be one of 0, 1, 2, 3, got {self.zero!r}.")
        if self.fsdp and self.zero not in (0, 3):
            raise PlanError(
                f"--fsdp is ZeRO-3 but --zero {self.zero} was asked for; give one of them."
            )
        if self.fsdp or self.zero == 3:
            object.__setattr__(self, "fsdp", True)
            object.__setattr__(self, "zero", 3)
        for name in ("microbatches", "virtual"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"--{name} must be a positive integer, got {value!r}.")
        if self.pp == "zbv" and self.virtual == 1:  # ZBV's V: two chunks per stage
            object.__setattr__(self, "virtual", 2)
        self._check_strategies()

    def _check_strategies(self) -> None:
        """PlanError (one sentence) where the strategies contradict the mesh or each other:
        every rule that needs no model. A model's own rules (its dims against the axes) are
        its ``check_plan``'s."""
        for failed, message in self._strategy_rules():
            if failed:
                raise PlanError(message + ".")

    def _strategy_rules(self) -> list[tuple[bool, str]]:
        data, stages, seq, model = (self.mesh[a] for a in ("data", "stage", "seq", "model"))
        pp, sp, ulysses, virtual = self.pp, self.sp, self.ulysses, self.virtual
        none = pp == "none"
        return [
            (self.zero > 0 and data == 1,
             f"--zero {self.zero} splits over data, but the mesh has data=1"),
            (self.zero == 2 and not none,
             f"--zero 2 cannot run under --pp {pp}: the schedule sums each layer's gradients "
             "over the microbatches before they are whole, so they cannot be reduce-scattered "
             "as backward makes them; use --zero 1 (the same memory here) or 3"),
            (sp == "none" and seq > 1,
             f"sp='none' does not split tokens over seq, but the mesh has seq={seq}; "
             "use --sp megatron, ring, ulysses or usp"),
            (sp == "megatron" and model == 1,
             "sp='megatron' splits tokens over the model axis, but the mesh has model=1"),
            (bool(self.overlap) and sp != "megatron" and not self.fsdp
             and not self.halves and (self.zero == 1 or data == seq == 1),
             "--overlap hides Megatron-SP's collective matmuls, plain TP's all-reduces, "
             "FSDP's gathers and scatters, ZeRO-2's and DP's per-layer gradient syncs (ZeRO-1 "
             "reduce-scatters once after backward: use --zero 2); this plan has none of them"),
            (self.overlap not in (False, True, "bidirectional"),
             f"--overlap takes no value or 'bidirectional', got {self.overlap!r}"),
            (self.overlap == "bidirectional" and sp != "megatron",
             "--overlap bidirectional runs Megatron-SP's collective matmuls both ways; this "
             f"plan has sp={sp!r}"),
            (bool(self.overlap) and (self.recompute or not none),
             "--overlap is not built yet with --remat or --pp (a recomputed or scheduled "
             "collective matmul re-runs its ring, which the cost model does not state)"),
            (sp in ("ring", "ulysses", "usp") and seq == 1,
             f"sp={sp!r} splits tokens over the seq axis, but the mesh has seq=1"),
            (ulysses is not None and sp not in ("usp", "megatron"),
             f"--ulysses {ulysses} only applies to sp='usp' or 'megatron', not sp={sp!r}"),
            (ulysses is not None and sp == "megatron" and seq == 1,
             f"--ulysses {ulysses} with sp='megatron' splits the seq axis, but the mesh has "
             "seq=1"),
            (none and stages > 1,
             f"The mesh has stage={stages} but no pipeline schedule; give --pp gpipe, 1f1b, "
             "interleaved, zb or zbv"),
            (none and self.microbatches > 1 and self.zero >= 2,
             f"--microbatches {self.microbatches} without --pp accumulates gradients over the "
             f"micro-batches, and --zero {self.zero} would gather or scatter the params once per "
             "micro-batch (not built); use --zero 1 or no ZeRO"),
            (none and self.microbatches > 1 and self.syncs_by_layer and data * seq > 1,
             f"--microbatches {self.microbatches} without --pp accumulates gradients, and "
             "--overlap's layer-by-layer gradient sync would run once per micro-batch (not "
             "built); drop --overlap"),
            (self.layers == "list" and not none,
             f"--layers list keeps each layer's params in their own arrays, and --pp {pp} cuts "
             "the stacked layers into chunks; use --layers scan or unrolled"),
            (none and virtual > 1, f"--virtual {virtual} only applies with --pp interleaved"),
            (not none and stages == 1,
             f"--pp {pp} needs a stage axis of size > 1 in --mesh (it has stage=1)"),
            (not none and virtual > 1 and pp != "interleaved" and (pp, virtual) != ("zbv", 2),
             f"--virtual {virtual} only applies to --pp interleaved, not --pp {pp}"),
        ]  # fmt: skip

    @property
    def unrolled(self) -> bool:
        """The blocks run as a Python loop (``layers`` "unrolled" or "list"): no layer loop in
        the compiled step."""
        return self.layers != "scan"

    @property
    def halves(self) -> bool:
        """``overlap`` on plain TP (model > 1, sp "none"): each device's batch runs as two
        half-batches a region apart, each one's all-reduces beside the other's matmuls
        (``tensor.pipelined_regions``)."""
        return bool(self.overlap) and self.mesh["model"] > 1 and self.sp == "none"

    @property
    def syncs_by_layer(self) -> bool:
        """``overlap`` with plain DP's gradient sync (no FSDP or ZeRO): the blocks' gradients
        are all-reduced layer by layer, under the next layer's backward
        (``data.sync_in_backward``)."""
        return bool(self.overlap) and self.zero == 0

    @property
    def prefetches_layers(self) -> bool:
        """``overlap`` with a per-layer param collective to move (FSDP's gathers, ZeRO-2's
        scatters, DP's layer-by-layer sync): the blocks run through ``data.prefetch_layers``,
        the last layer after a loop of depth − 1 trips."""
        return bool(self.overlap) and (self.fsdp or self.zero == 2 or self.syncs_by_layer)

    @property
    def recompute(self) -> bool:
        """Whether the blocks recompute anything in backward (``remat`` is not "none")."""
        return self.remat != "none"

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.values())

    def size(self, axis: str) -> int:
        return self.mesh[axis]


def logical_specs(axes_tree: Any, rules: dict[str, str]) -> Any:
    """PartitionSpecs from logical axis names: one rules table, no per-weight ``P(...)``.

    ``axes_tree`` holds, per array, a tuple of logical names (or None) per dim, e.g.
    ``("embed", "mlp")``; ``rules`` maps logical names to mesh axes, e.g.
    ``{"mlp": "model", "embed": "data"}``. Unmapped names are replicated.
    """
    return jax.tree.map(
        lambda names: P(*(rules.get(n) if n else None for n in names)),
        axes_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def without_axes(specs: Any, axes: Sequence[str]) -> Any:
    """``specs`` with ``axes`` removed from every entry (what stays split over the rest)."""

    def entry(e: Any) -> Any:
        kept = tuple(a for a in ((e,) if isinstance(e, str) else tuple(e or ())) if a not in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    def without(spec: P) -> P:
        entries = [entry(e) for e in spec]
        while entries and entries[-1] is None:  # P(None, None) is P(), spelt as logical_specs does
            entries.pop()
        return P(*entries)

    return jax.tree.map(without, specs, is_leaf=lambda x: isinstance(x, P))


def spec_axes(spec: P) -> tuple[str, ...]:
    """The mesh axes a spec splits over, in dim order (a dim may name several)."""
    out: list[str] = []
    for entry in spec:
        out += [entry] if isinstance(entry, str) else list(entry or ())
    return tuple(out)


def _padded(spec: P, ndim: int) -> tuple[Any, ...]:
    """The spec's entries, one per dim (a spec may name fewer dims than the array has)."""
    return tuple(spec) + (None,) * (ndim - len(spec))


def leaf_path(path: tuple[Any, ...]) -> str:
    """``"blocks/mlp/fc1/kernel"`` for a pytree key path (the form ``token_free`` matches)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def check_divisible(shapes: Any, specs: Any, axes_tree: Any, mesh: Mesh) -> None:
    """Raises PlanError naming the first leaf whose split dim is not divisible by its axes.

    ``shapes`` holds arrays or anything with ``.shape``; ``specs`` and ``axes_tree`` match it.
    """
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    flat_names = jax.tree.leaves(axes_tree, is_leaf=lambda x: isinstance(x, tuple))
    flat_shapes = jax.tree_util.tree_leaves_with_path(shapes)
    if not len(flat_shapes) == len(flat_specs) == len(flat_names):
        raise PlanError(
            f"The params have {len(flat_shapes)} leaves but param_axes names {len(flat_names)}: "
            "give one tuple of logical names per leaf."
        )
    for (path, leaf), spec, names in zip(flat_shapes, flat_specs, flat_names, strict=True):
        shape = tuple(leaf.shape)
        if len(names) != len(shape):
            raise PlanError(
                f"Param {leaf_path(path)} has {len(shape)} dims {shape} but param_axes names "
                f"{len(names)}: {names}."
            )
        for dim, (size, entry) in enumerate(zip(shape, _padded(spec, len(shape)), strict=True)):
            axes = spec_axes(P(entry))
            n = math.prod(mesh.shape[a] for a in axes)
            if size % n:
                split = "×".join(f"{a}={mesh.shape[a]}" for a in axes)
                raise PlanError(
                    f"Param {leaf_path(path)} dim {dim} ({names[dim]}, size {size}) is not "
                    f"divisible by {split}."
                )
