"""shardkit: hand-written tensor, sequence and data parallelism in JAX ``shard_map``."""

from shardkit.mesh import AXES, SP_MODES, Plan, PlanError, make_mesh, parse_mesh, set_cpu_devices

__all__ = ["AXES", "SP_MODES", "Plan", "PlanError", "make_mesh", "parse_mesh", "set_cpu_devices"]
