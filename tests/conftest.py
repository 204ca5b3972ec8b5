"""Test setup: 8 CPU devices before any backend exists, strict numerics, hypothesis profiles.

Profiles: ``ci`` (default; derandomized, fixed example counts, no deadline) keeps the suite
inside CI's budget; ``thorough`` runs many more examples:
``HYPOTHESIS_PROFILE=thorough python -m pytest``.
"""

import atexit
import os
import shutil
import tempfile

# libtpu (the tpu extra, for inspect --target) is installed: keep every test process's own
# backend on the CPU, and let several processes load libtpu to compile (it locks otherwise).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# XLA:CPU aborts a collective whose device threads do not all arrive within 40 s; on 2 busy
# cores a starved (not deadlocked) thread can take that long. 300 s for the tests and every
# process they start (the examples' hang guard is 600 s). The deadlock CI did hit, several
# in-flight executions of one 8-device program, is avoided in the examples themselves.
# The tests are compile-bound (small models, few steps): LLVM at -O0 compiles XLA:CPU programs
# about a third faster and changes no HLO pass, so the compiled programs' collectives, bytes and
# memory (what contracts assert) are those of a default build.
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_cpu_collective_call_terminate_timeout_seconds=300",
        "--xla_backend_optimization_level=0",
    ]
).strip()

# One persistent compilation cache per test run, shared by the xdist workers and every process
# the tests start (they inherit the environment; the first process, xdist's controller, makes
# the folder): the suite compiles many identical programs in different files and processes,
# and each is compiled once per run. A fresh folder each run, so nothing outlives it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardkit-tests-jax-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# XLA:CPU compiles in well under the default 1 s threshold: cache every program.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax
import pytest
from hypothesis import HealthCheck, settings

jax.config.update("jax_num_cpu_devices", 8)
# Start the backend now, so in-process CLI calls (which ask for --devices N) find 8 devices
# whatever the test order.
assert len(jax.devices()) == 8
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=4, derandomize=True, print_blob=True, **_common)
settings.register_profile("thorough", max_examples=100, print_blob=True, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_caches():
    """Each test file starts from empty JAX caches: compiled programs are shared within a file,
    and a long session does not carry every earlier file's executables."""
    yield
    jax.clear_caches()
