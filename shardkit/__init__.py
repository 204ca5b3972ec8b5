"""shardkit: hand-written tensor, sequence and data parallelism in JAX ``shard_map``.

Modules (each usable on its own; primitives assume no particular model):
  mesh         CPU devices, ``data × seq × model`` meshes, the ``Plan``
  collectives  wrappers, ring / bidirectional collectives from ppermute, Megatron f / g
  tensor       column / row-parallel dense, head-split attention, the TP MLP
  sequence     ring attention, Ulysses, USP, token padding
  data         gradient sync, FSDP gather, ZeRO-1
  vit          ``ShardedViT``: vit_ref's model on any plan, same params pytree
  ledger       collectives measured from compiled HLO
  testing      tree comparison and hypothesis strategies for your own models
  verify       sharded == reference, case by case
"""

from shardkit.collectives import (
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
from shardkit.vit import ShardedViT, check_plan

__all__ = [
    "AXES",
    "SP_MODES",
    "Plan",
    "PlanError",
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
    "reduce_scatter",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_shift",
    "set_cpu_devices",
]
