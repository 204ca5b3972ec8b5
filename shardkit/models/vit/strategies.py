"""Hypothesis strategies for the ViT: configs small enough for CPU meshes and plans whose every
divisibility constraint holds (``sharded_cases``, ``pipeline_cases``), so a failure is real.

Built on the model-free ``shardkit.testing`` (meshes as factorisations of the device count).
Imports hypothesis: tests only, never loaded by ``import shardkit``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from hypothesis import strategies as st

import vit_ref
from shardkit.mesh import LAYER_LOOPS, REMAT_POLICIES, ZERO_LEVELS, Plan
from shardkit.parallel.pipeline.schedules import SCHEDULES
from shardkit.testing import DEFAULT_AXES, meshes


@st.composite
def vit_configs(
    draw: st.DrawFn, heads_multiple: int = 1, mlp_multiple: int = 1, dim_multiple: int = 1
) -> vit_ref.ViTConfig:
    """A small random ViT (depth ≥ 2, both pools, both posembs, random head) for CPU tests.

    Images hold 1 to 16 patches: tiny ones give fewer tokens than a sequence-parallel axis has
    devices (blocks of pure padding), larger ones token counts that do not divide.
    """
    heads = heads_multiple * draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([4, 8]))
    dim = math.lcm(heads * head_dim, dim_multiple, 4)
    dim *= -(-8 // dim)  # sincos2d needs dim ≥ 8; a multiple keeps every divisibility
    patch = draw(st.sampled_from([2, 4]))
    grid = draw(st.integers(1, 4))
    return vit_ref.ViTConfig(
        image=patch * grid,
        patch=patch,
        channels=draw(st.sampled_from([1, 3])),
        classes=draw(st.integers(2, 7)),
        dim=dim,
        depth=draw(st.integers(2, 3)),
        heads=heads,
        mlp_dim=mlp_multiple * 4 * draw(st.integers(1, 3)),
        pool=draw(st.sampled_from(["tok", "gap"])),
        posemb=draw(st.sampled_from(["learn", "sincos2d"])),
        head_zeroinit=False,
    )


SEQ_MODES = ("ring", "ulysses", "usp")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def sharded_cases(
    draw: st.DrawFn,
    max_devices: int = 8,
    sp_modes: tuple[str, ...] = ("none",),
    zero: int | None = None,
    remat: str | bool | None = None,
) -> tuple[vit_ref.ViTConfig, Plan, int]:
    """(cfg, plan, batch) that fit each other: every divisibility constraint holds.

    ``zero`` (the ZeRO level, 3 = FSDP; any level needs data > 1) / ``remat``: None draws
    them; the layer loop (scan or unrolled) is always drawn, and ``overlap`` wherever the
    plan allows it (Megatron-SP, rings one way or both; TP's half-batches; FSDP, ZeRO-2,
    DP's sync; no remat), and 1 or 2 micro-batches of gradient accumulation wherever the
    plan allows them (ZeRO 0 or 1, no layer-by-layer sync). For ``usp`` the Ulysses degree
    u is drawn among the divisors of the seq size (heads per model shard then divide by u)
    and given explicitly or left to the automatic choice, so true hybrids (1 < u < seq)
    occur, not only the pure ends.
    ``megatron`` draws a seq axis too (tokens over seq × model), with its inner core a ring
    or, given u explicitly, Ulysses / USP.
    """
    sp = draw(st.sampled_from(sp_modes))
    axes = ("data", "model") if sp == "none" else DEFAULT_AXES
    mesh = draw(meshes(max_devices, axes))
    # A mode whose axis drew size 1 degenerates to plain TP/DP (still a valid, useful case).
    if (sp == "megatron" and mesh["model"] == 1) or (sp in SEQ_MODES and mesh["seq"] == 1):
        sp = "ring" if sp == "megatron" and mesh["seq"] > 1 else "none"
    if zero is None:
        zero = draw(st.sampled_from(ZERO_LEVELS)) if mesh["data"] > 1 else 0
    if remat is None:
        use_remat = draw(st.sampled_from(REMAT_POLICIES))
    elif isinstance(remat, bool):
        use_remat = "full" if remat else "none"
    else:
        use_remat = remat
    ulysses = {"ulysses": mesh["seq"]}.get(sp, 1)
    explicit_ulysses = None
    if sp == "usp" or (sp == "megatron" and mesh["seq"] > 1):
        # Megatron-SP over seq: a ring inside attention unless a Ulysses degree is given.
        ulysses = draw(st.sampled_from(_divisors(mesh["seq"])))
        explicit_ulysses = draw(st.sampled_from([None, ulysses]))
        if sp == "megatron" and explicit_ulysses is None:
            ulysses = 1
    heads_multiple = mesh["model"] * ulysses
    cfg = draw(vit_configs(heads_multiple, mesh["model"], mesh["data"] if zero else 1))
    layers = draw(st.sampled_from(LAYER_LOOPS))
    # --overlap (no remat): Megatron-SP's rings, plain TP's half-batches, FSDP's gathers one
    # layer ahead, ZeRO-2's scatters and DP's sync (over data and the token axes) one behind.
    syncs = zero == 0 and (mesh["data"] > 1 or mesh["seq"] > 1)
    halves = sp == "none" and mesh["model"] > 1
    can_overlap = (sp == "megatron" or halves or zero in (2, 3) or syncs) and use_remat == "none"
    forms: list[bool | str] = [False, True, "bidirectional"] if sp == "megatron" else [False, True]
    overlap: bool | str = draw(st.sampled_from(forms)) if can_overlap else False
    # Gradient accumulation wherever no param collective would run once per micro-batch.
    micro = draw(st.sampled_from((1, 2))) if zero <= 1 and not (overlap and syncs) else 1
    # Rings both ways halve the token rows, the half-batches the batch: an even local batch.
    even = 2 if overlap == "bidirectional" or (overlap and halves) else 1
    batch = mesh["data"] * micro * even * draw(st.integers(1, 2))
    plan = Plan(mesh, sp=sp, ulysses=explicit_ulysses, zero=zero, remat=use_remat, layers=layers,
                overlap=overlap, microbatches=micro)  # fmt: skip
    return cfg, plan, batch


@st.composite
def pipeline_cases(
    draw: st.DrawFn, max_devices: int = 8, schedules: Sequence[str] = SCHEDULES
) -> tuple[vit_ref.ViTConfig, Plan, int]:
    """(cfg, plan, batch) of a pipelined ViT: a schedule over stage = 2..max_devices, composed
    with whatever data, seq and model the remaining devices allow, ZeRO 0, 1 or 3 (FSDP).

    M is drawn as the schedule allows: any 1..2S for GPipe and 1F1B (multiples of S or not),
    a multiple of S for interleaved (V = 1 or 2), S..2S for zb and zbv (V = 2). Tokens over
    seq run Ulysses or a ring (the engine's uniform form, ``parallel.pipeline``); with model >
    1 the mode may be Megatron-SP (its core over seq Ulysses or a ring). One layer per chunk:
    depth = S·V.
    """
    pp = draw(st.sampled_from(list(schedules)))
    stages = draw(st.integers(2, max_devices))
    mesh = {**draw(meshes(max_devices // stages)), "stage": stages}
    seq, model = mesh["seq"], mesh["model"]
    virtual = draw(st.integers(1, 2)) if pp == "interleaved" else 2 if pp == "zbv" else 1
    if pp == "interleaved":
        micro = stages * draw(st.integers(1, 2))
    elif pp in ("zb", "zbv"):
        micro = draw(st.integers(stages, 2 * stages))
    else:
        micro = draw(st.integers(1, 2 * stages))
    sp = draw(st.sampled_from(("ulysses", "ring"))) if seq > 1 else "none"
    ring = sp == "ring"
    if model > 1 and draw(st.booleans()):
        sp = "megatron"
    zero = draw(st.sampled_from((0, 1, 3))) if mesh["data"] > 1 else 0  # ZeRO-2: refused
    cfg = draw(vit_configs(model * seq, model, mesh["data"] if zero else 1))
    cfg = dataclasses.replace(cfg, depth=stages * virtual)
    plan = Plan(
        mesh,
        sp=sp,
        ulysses=seq if sp == "megatron" and seq > 1 and not ring else None,
        zero=zero,
        pp=pp,
        microbatches=micro,
        virtual=virtual,
    )
    return cfg, plan, mesh["data"] * micro
