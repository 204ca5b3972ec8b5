"""The smallest reproduction of why a pipeline stage cannot run a ppermute inside its branch.

    python docs/measure/permute_in_branch.py      # about a minute, on CPU devices

Four devices as stage=2 × seq=2. Every device runs ``lax.switch(stage, branches)``: stage 0 takes
a branch that rotates its value round the ``seq`` ring (one ``ppermute`` over seq), stage 1 an
identity branch. The groups of that ppermute lie within stage 0 (devices 0 and 1 swap), so a
per-group collective would be sound, as ``psum`` over seq is in the same position. But XLA
lowers the ppermute to ONE collective-permute instruction whose source-target pairs name every
seq pair of the mesh, stage 1's included; stage 1's devices never execute it. Each case runs
in a child process (the broken one does not come back): ``psum`` over seq returns the right
values; the ``ppermute`` waits at a rendezvous of all 4 devices that only stage 0's 2 reach,
and XLA:CPU aborts the process after its 40 s termination timeout (measured on jax 0.10.2;
inside the pipeline engine, where every tick's own stage ppermute also rendezvouses, it ran
through with wrong values instead). Naming only stage 0's devices in the pairs (a ppermute over
``("stage", "seq")``) does not help: XLA:CPU's collective-permute rendezvous waits for every
device of the program, whatever its pairs.

The fourth case is the pipeline engine's uniform form: every device takes the SAME branch (the
index is the same on all of them, as a uniform super tick's phase variant is), runs the ring,
and stage 1 masks the result away (``jnp.where``). It returns the right values.
"""

import subprocess
import sys

import shardkit

shardkit.set_cpu_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from shardkit.parallel.vma import vary, varying_axes  # noqa: E402


def run(collective: str) -> tuple[np.ndarray, np.ndarray]:
    """(what a branch with ``collective`` over seq returned on stage 0, what it must return)."""
    mesh = shardkit.make_mesh({"stage": 2, "seq": 2})

    def ring(x):
        if collective in ("ppermute", "uniform"):
            return jax.lax.ppermute(x, "seq", [(0, 1), (1, 0)])
        if collective == "stage-0 pairs":  # over (stage, seq), naming stage 0's devices only
            return jax.lax.ppermute(x, ("stage", "seq"), [(0, 1), (1, 0)])
        return vary(jax.lax.psum(x, "seq"), varying_axes(x))  # typed like the other branch

    def body(x, uniform_index):
        stage = jax.lax.axis_index("stage")
        if collective == "uniform":  # one branch for all (a traced index, 0 everywhere)
            ran = jax.lax.switch(uniform_index, [ring, lambda x: x], x)
            return jnp.where(stage == 0, ran, x)  # stage 1 masks what it computed
        return jax.lax.switch(stage, [ring, lambda x: x], x)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(("stage", "seq")), P()),
                                 out_specs=P(("stage", "seq"))))  # fmt: skip
    x = jnp.arange(4.0)  # device (stage s, seq i) holds 2s + i
    got = np.asarray(step(x, jnp.int32(0)))[:2]
    want = np.array([1.0, 1.0]) if collective == "psum" else np.array([1.0, 0.0])
    return got, want


def child(name: str) -> None:
    got, want = run(name)
    verdict = "right" if np.allclose(got, want) else "WRONG, no error raised"
    print(f"got {got}, want {want}: {verdict}")


def main() -> None:
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    for name in ("psum", "ppermute", "stage-0 pairs", "uniform"):
        proc = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        lines = [line for line in proc.stderr.splitlines() if "Termination timeout" in line]
        outcome = (
            proc.stdout.strip().splitlines()[-1]
            if proc.returncode == 0
            else (
                f"process aborted (exit {proc.returncode}): "
                + (lines[0].split("] ")[-1] if lines else proc.stderr[-300:])
            )
        )
        where = "in one branch for all" if name == "uniform" else "inside stage 0's branch"
        print(f"{name:>13} {where}: {outcome}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
    else:
        main()
