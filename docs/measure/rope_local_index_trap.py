"""What RoPE at the LOCAL token index costs under ring + zigzag (docs/llama.md, CPU).

The example's decoder verified twice on data=2,seq=4 with the zigzag layout: once with
``layouts.local_positions`` (global positions) and once with ``arange(t_local)``, the bug.

    python docs/measure/rope_local_index_trap.py
"""

import importlib.util
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpt", ROOT / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpt)

params = gpt.init(0, gpt.DIMS)
x, y = gpt.windows(np.random.default_rng(0), 8, gpt.DIMS["tokens"])
plan = ("data=2,seq=4", "zigzag", "ring", False)
right = gpt.verify(*plan, params, x, y)
print(f"global positions: worst {right.worst[0]} at {right.worst[1]:.1e}")
gpt.layouts.local_positions = lambda layout, axis, t: gpt.jnp.arange(t)  # the trap
wrong = gpt.verify(*plan, params, x, y)
print(f"local index:      worst {wrong.worst[0]} at {wrong.worst[1]:.1e}")
