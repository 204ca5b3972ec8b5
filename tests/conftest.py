"""Test setup: 8 CPU devices before any backend exists, strict numerics, hypothesis profiles.

Profiles: ``ci`` (default; derandomized, fixed example counts, no deadline) keeps the suite
inside CI's budget; ``thorough`` runs many more examples:
``HYPOTHESIS_PROFILE=thorough python -m pytest``.
"""

import os

# libtpu (the tpu extra, for inspect --target) is installed: keep every test process's own
# backend on the CPU, and let several processes load libtpu to compile (it locks otherwise).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# On 2 busy cores (two workers, each running 8-device programs and subprocesses) an example's
# collective-permute twice waited forever for its 8th device thread (7 of 8 arrived; exit -6
# after XLA:CPU's terminate timeout): a device thread wedged in XLA:CPU's multi-threaded Eigen
# pool, the hang others report with the same cure (XLA's Eigen pool off: one thread per op;
# each device already has its own). For the tests and every process they start; the terminate
# timeout is raised so that a starved (not wedged) thread is not killed at 40 s.
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_cpu_multi_thread_eigen=false",
        "--xla_cpu_collective_call_terminate_timeout_seconds=300",
    ]
).strip()

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
settings.register_profile("ci", max_examples=6, derandomize=True, print_blob=True, **_common)
settings.register_profile("thorough", max_examples=100, print_blob=True, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_caches():
    """Each test file starts from empty JAX caches: compiled programs are shared within a file,
    and a long session does not carry every earlier file's executables."""
    yield
    jax.clear_caches()
