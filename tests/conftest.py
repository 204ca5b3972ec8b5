"""Test setup: 8 CPU devices before any backend exists, strict numerics, hypothesis profiles.

Profiles: ``ci`` (default; derandomized, fixed example counts, no deadline) keeps the suite
inside CI's budget; ``thorough`` runs many more examples:
``HYPOTHESIS_PROFILE=thorough python -m pytest``.
"""

import os

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
