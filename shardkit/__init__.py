"""shardkit: hand-written tensor, sequence, data, pipeline and expert parallelism in JAX
``shard_map``.

Layers (``cli → run → models → {comm, parallel} → mesh``; each imports only those below it,
docs/design.md says where new code goes):
  mesh         CPU devices, ``data × stage × expert × seq × model`` meshes, the ``Plan``
  parallel/    primitives for shard_map bodies, model-free: vma typing, collectives, tensor,
               lm (RMSNorm, RoPE, vocab-parallel embedding / loss), data, moe,
               sequence/ (blockwise, ring, Ulysses/USP, layouts, modes), pipeline/
               (schedules, tables, engine)
  comm/        any program's communication: hlo (parser), ledger, bytes (ring formulas),
               terms, contract, report, plot — no model
  models/      sharded: ``ShardedModel`` for any model; vit/: ``ShardedViT``, its plan, cost
               model, report and test strategies
  run/         what each command does: verify, inspect, train, bench, launch, checkpoints
  testing      tree comparison and mesh strategies for your own models (imports hypothesis:
               import it explicitly; ``import shardkit`` does not)
  cli          the ``shardkit`` command: parsing and printing only

This module imports no runner and no test library.
"""

from shardkit.comm import contract, ledger, report
from shardkit.mesh import (
    AXES,
    SP_MODES,
    Plan,
    PlanError,
    format_mesh,
    logical_specs,
    make_mesh,
    parse_mesh,
    set_cpu_devices,
)
from shardkit.models import sharded, vit
from shardkit.models.sharded import ShardedModel
from shardkit.models.vit import ShardedViT, check_plan
from shardkit.parallel import collectives, data, lm, moe, pipeline, sequence, tensor, vma
from shardkit.parallel.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    axis_index,
    axis_size,
    bidir_all_gather,
    bidir_all_reduce,
    bidir_reduce_scatter,
    megatron_f,
    megatron_g,
    permute,
    reduce_scatter,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    ring_shift,
)
from shardkit.parallel.pipeline import schedules

__all__ = [
    "AXES",
    "SP_MODES",
    "Plan",
    "PlanError",
    "ShardedModel",
    "ShardedViT",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "axis_index",
    "axis_size",
    "bidir_all_gather",
    "bidir_all_reduce",
    "bidir_reduce_scatter",
    "check_plan",
    "collectives",
    "contract",
    "data",
    "format_mesh",
    "ledger",
    "lm",
    "logical_specs",
    "make_mesh",
    "megatron_f",
    "megatron_g",
    "moe",
    "parse_mesh",
    "permute",
    "pipeline",
    "reduce_scatter",
    "report",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_shift",
    "schedules",
    "sequence",
    "set_cpu_devices",
    "sharded",
    "tensor",
    "vit",
    "vma",
]
