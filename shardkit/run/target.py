"""Compile for a TPU pod slice from any machine: ``shardkit inspect --target v5e:2x4``.

The slice's devices come from libtpu's topology description
(``jax.experimental.topologies.get_topology_desc``: no chip needed, only libtpu installed, the
``shardkit[tpu]`` extra); the plan's mesh is built over them, its train step lowered with
abstract arguments and compiled by the TPU compiler, and the ledger and the contract read the
TPU compiler's program. The per-chip memory (argument + output + temp − aliased, from
``memory_analysis``) is held against the chip's HBM (``HBM_BYTES`` by device kind): a plan that
does not fit is one sentence naming the memory and the largest buffers of the program.

libtpu takes a machine-wide lock and, where no chip is attached, prints its initialisation
failures to the process's stderr; the topology is read with that output silenced, with
``ALLOW_MULTIPLE_LIBTPU_LOAD`` set (a compile-only client needs no exclusive chip), and the
command's own backend stays the CPU (``JAX_PLATFORMS=cpu``, set before JAX starts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from shardkit.comm import hlo
from shardkit.comm.ledger import Memory

GIB = 1 << 30
# HBM per chip (vendor figures), by ``device_kind``.
HBM_BYTES = {
    "TPU v4": 32 * GIB,
    "TPU v5 lite": 16 * GIB,  # v5e
    "TPU v5e": 16 * GIB,
    "TPU v5": 95 * GIB,  # v5p
    "TPU v5p": 95 * GIB,
    "TPU v6 lite": 32 * GIB,  # v6e
}
EXAMPLES = "v5e:2x4, v5e:16x16 or v5p:4x4x4"


class TargetError(ValueError):
    """A target that cannot be compiled for, or a plan that does not fit it (one sentence)."""


# libtpu's compiler options (``--tpu-flags``), passed to each compile (a compile-only client
# does not read LIBTPU_INIT_ARGS). "maxtext": what MaxText's v5e runs set to overlap
# collectives with compute (its LIBTPU_INIT_ARGS), plus async all-to-alls.
TPU_FLAGS: dict[str, dict[str, str]] = {
    "default": {},
    "maxtext": dict.fromkeys((
        "xla_tpu_enable_data_parallel_all_reduce_opt",
        "xla_tpu_data_parallel_opt_different_sized_ops",
        "xla_tpu_enable_async_collective_fusion",
        "xla_tpu_enable_async_collective_fusion_fuse_all_gather",
        "xla_tpu_enable_async_collective_fusion_multiple_steps",
        "xla_tpu_overlap_compute_collective_tc",
        "xla_enable_async_all_gather",
        "xla_tpu_enable_async_all_to_all",
    ), "true"),
}  # fmt: skip


def prepare_environment() -> None:
    """Before JAX starts: the command's own backend is the CPU, and libtpu may be loaded by
    several processes at once (compile-only)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@contextlib.contextmanager
def uncached() -> Iterator[None]:
    """Compiles in this block skip JAX's persistent compilation cache: an executable compiled
    for a topology (no chip) cannot be read back from it ("PjRtCompiler must be constructed
    with a Client"), so a second compile of the same step would fail where it should hit. JAX
    decides once per process whether it uses the cache; ``reset_cache`` makes it decide again,
    on the way in and out."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    before = getattr(jax.config, "jax_enable_compilation_cache")  # noqa: B009 (untyped attr)
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null (libtpu's native initialisation messages)."""
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def topology_devices(topology: str, mesh_devices: int | None = None) -> np.ndarray:
    """The devices of the TPU slice ``topology`` (e.g. "v5e:2x4"), compiled for, not run on;
    ``mesh_devices``: the devices the plan's mesh uses (a mismatch is a ``TargetError``)."""
    if importlib.util.find_spec("libtpu") is None:
        raise TargetError(
            "--target compiles with the TPU compiler, which needs libtpu: "
            "pip install 'shardkit[tpu]' (jax[tpu] of the installed JAX version)."
        )
    prepare_environment()
    from jax.experimental import topologies

    try:
        with _quiet_stderr():
            desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as err:  # libtpu's errors are RuntimeErrors and XlaRuntimeErrors
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise TargetError(
            f"libtpu does not know the topology {topology!r} ({first}); names look like {EXAMPLES}."
        ) from None
    if mesh_devices is not None and mesh_devices != len(desc.devices):
        n = len(desc.devices)
        raise TargetError(f"--target {topology} has {n} chips but the mesh uses {mesh_devices}; "
                          f"give a --mesh of {n} devices.")  # fmt: skip
    return np.array(desc.devices)


@dataclasses.dataclass(frozen=True)
class Fit:
    """A compiled step's per-chip memory against the chip's HBM."""

    device_kind: str
    hbm_bytes: int | None  # None: a chip missing from HBM_BYTES (the fit is then unknown)
    peak_bytes: int
    argument_bytes: int
    temp_bytes: int
    largest: tuple[tuple[str, int], ...]  # (shape, bytes) of the program's largest buffers

    @property
    def fits(self) -> bool | None:
        return None if self.hbm_bytes is None else self.peak_bytes <= self.hbm_bytes

    def line(self) -> str:
        if self.hbm_bytes is None:
            return f"{self.device_kind}: {self.peak_bytes / GIB:.2f} GiB per chip (HBM unknown)"
        verdict = "fits" if self.fits else "does NOT fit"
        return (
            f"{verdict} a {self.device_kind} chip: {self.peak_bytes / GIB:.2f} of "
            f"{self.hbm_bytes / GIB:.1f} GiB per chip (arguments {self.argument_bytes / GIB:.2f}, "
            f"temp {self.temp_bytes / GIB:.2f})"
        )

    def error(self) -> str:
        """The sentence for a plan that does not fit."""
        biggest = ", ".join(f"{shape} {size / GIB:.2f} GiB" for shape, size in self.largest)
        return f"The plan {self.line().removeprefix('does NOT fit ')}; largest buffers: {biggest}."

    def to_json(self) -> dict[str, Any]:
        return {
            "device_kind": self.device_kind,
            "hbm_bytes": self.hbm_bytes,
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "largest": [{"shape": s, "bytes": b} for s, b in self.largest],
        }


def fit_of(memory: Memory, hlo_text: str, device_kind: str, top: int = 3) -> Fit:
    """The ``Fit`` of a compiled step from its ledger's memory and its HLO text."""
    return Fit(
        device_kind,
        HBM_BYTES.get(device_kind),
        memory.peak,
        memory.argument,
        memory.temp,
        largest_buffers(hlo_text, top),
    )


_MLIR_TENSOR = re.compile(r"tensor<((?:\d+x)+)([a-z]+\d*)>")
_MLIR_DTYPES = {"f32": "f32", "bf16": "bf16", "f16": "f16", "i32": "s32", "ui32": "u32",
                "i8": "s8", "i1": "pred", "f64": "f64", "i64": "s64"}  # fmt: skip


def compile_error(err: Exception, lowered_text: str, device_kind: str) -> TargetError | None:
    """The one-sentence error for a step the TPU compiler refused for want of HBM (it stops
    before any memory analysis exists), naming the largest arrays of the lowered program;
    None for any other compile error."""
    message = (str(err).strip().splitlines() or [""])[0]
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    sizes: dict[str, int] = {}
    for dims, dtype in _MLIR_TENSOR.findall(lowered_text):
        name = _MLIR_DTYPES.get(dtype, dtype)
        shape = tuple(int(d) for d in dims.rstrip("x").split("x"))
        sizes[f"{name}[{','.join(map(str, shape))}]"] = hlo.leaf_bytes(name, shape)
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    biggest = ", ".join(f"{shape} {size / GIB:.2f} GiB" for shape, size in ranked)
    detail = message.removeprefix("RESOURCE_EXHAUSTED: ").rstrip(".")
    return TargetError(
        f"The plan does not fit a {device_kind} chip ({detail}); largest arrays of the step: "
        f"{biggest}."
    )


def largest_buffers(hlo_text: str, top: int = 3) -> tuple[tuple[str, int], ...]:
    """The ``top`` largest array shapes any instruction of the program produces (parameters
    included: weights and optimizer state count against HBM too), largest first."""
    computations, _ = hlo.split_computations(hlo_text)
    sizes: dict[str, int] = {}
    for instructions in computations.values():
        for instr in instructions:
            for dtype, dims in hlo.leaves(instr.shape):
                shape = f"{dtype}[{','.join(map(str, dims))}]"
                sizes[shape] = hlo.leaf_bytes(dtype, dims)
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])
    return tuple(ranked[:top])
