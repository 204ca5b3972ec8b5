#!/usr/bin/env bash
# On a TPU host (the `device` tool's v5e): shardkit bench --chip beside the big_vision recipe,
# and verify on one chip. Usage: bash docs/measure/tpu_chip.sh BATCHES REMATS
# Results land in $OUT (default /tmp/out): chip.json, bigvision.json, verify.txt.
set -euo pipefail
BATCHES=${1:-32,64,128,256}
REMATS=${2:-dots}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PIP_CONFIG_FILE=/dev/null python3 -m pip install -q --isolated --only-binary=:all: \
  --index-url file:///opt/pypi/simple --target /tmp/site optax einops jaxtyping tqdm flax \
  2>&1 | grep -v "^WARNING" || true
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import jax; print(jax.devices())"
python3 -m shardkit.cli verify --devices 1 2>&1 | tee "$OUT/verify.txt"
python3 -m shardkit.cli bench --chip --batches "$BATCHES" --remats "$REMATS" --json \
  > "$OUT/chip.json"
python3 - "$OUT/chip.json" <<'PY'
import json, sys
from shardkit.run.throughput import format_table
print(format_table(json.load(open(sys.argv[1]))))
PY
python3 docs/measure/tpu_bigvision.py --batches "$BATCHES" --json "$OUT/bigvision.json"
