"""shardkit: hand-written tensor, sequence and data parallelism in JAX ``shard_map``.

Layers (each imports only the ones below it; primitives assume no particular model):
  mesh         CPU devices, ``data × stage × seq × model`` meshes, the ``Plan``
  parallel/    collectives, tensor, sequence, data, schedules + pipeline: primitives for
               shard_map bodies
  models/      sharded: ``ShardedModel``, any model's specs, sync, optimizer layout and
               train step from logical axes; vit: ``ShardedViT``, vit_ref's model on it
  comm/        ledger (collectives measured from compiled HLO), cost, report, plot
  run/         verify (sharded == reference), train
  testing      tree comparison and hypothesis strategies for your own models
  cli          the ``shardkit`` command

The flat module paths of earlier releases (``shardkit.collectives``, ``shardkit.vit``,
``shardkit.ledger``, ...) stay importable: ``_MOVED`` registers each as an alias of the module
itself (the same object, so ``from shardkit.vit import X`` and monkeypatching both work).
"""

import sys

from shardkit.comm import cost, ledger, plot, report
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
from shardkit.parallel import collectives, data, pipeline, schedules, sequence, tensor
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
from shardkit.run import verify

_MOVED = {
    "collectives": collectives,
    "tensor": tensor,
    "sequence": sequence,
    "data": data,
    "vit": vit,
    "ledger": ledger,
    "cost": cost,
    "report": report,
    "plot": plot,
    "verify": verify,
}
for _name, _module in _MOVED.items():
    sys.modules[f"{__name__}.{_name}"] = _module

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
    "format_mesh",
    "logical_specs",
    "make_mesh",
    "megatron_f",
    "megatron_g",
    "parse_mesh",
    "permute",
    "pipeline",
    "reduce_scatter",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_shift",
    "schedules",
    "set_cpu_devices",
    "sharded",
]
