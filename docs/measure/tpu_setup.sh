# Sourced by the docs/measure/tpu_*.sh scripts on a TPU host (the `device` tool's machine): the
# project's dependencies from the host's own package index into /tmp/site, the checkout on the
# path, and $OUT (default /tmp/out) made.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PIP_CONFIG_FILE=/dev/null python3 -m pip install -q --isolated --only-binary=:all: \
  --index-url file:///opt/pypi/simple --target /tmp/site optax einops jaxtyping tqdm flax \
  2>&1 | grep -v "^WARNING" || true
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site:$PWD PYTHONUNBUFFERED=1
