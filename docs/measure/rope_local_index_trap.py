"""What RoPE at the LOCAL token index costs under ring + zigzag (docs/llama.md, CPU).

The GPT (``shardkit.models.gpt``) verified twice on data=2,seq=4 with the zigzag layout: once
with ``layouts.local_positions`` (global positions) and once with ``arange(t_local)``, the bug.

    python docs/measure/rope_local_index_trap.py
"""

import importlib.util
import pathlib

import shardkit

shardkit.set_cpu_devices(8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from shardkit.models import gpt  # noqa: E402
from shardkit.parallel.sequence import layouts  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

cfg = gpt.GPTConfig()
params = gpt.init(0, cfg)
x, y = gpt.windows(np.random.default_rng(0), 8, cfg.tokens)
plan = gpt.GPTPlan({"data": 2, "seq": 4}, "zigzag", "ring")
right = example.verify(cfg, plan, params, x, y)
print(f"global positions: worst {right.worst[0]} at {right.worst[1]:.1e}")
layouts.local_positions = lambda layout, axis, t: jnp.arange(t)  # the trap
wrong = example.verify(cfg, plan, params, x, y)
print(f"local index:      worst {wrong.worst[0]} at {wrong.worst[1]:.1e}")
