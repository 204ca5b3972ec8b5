#!/usr/bin/env bash
# On a TPU host (the `device` tool's v5e): shardkit bench --chip, or the big_vision recipe and
# verify on one chip. Results land in $OUT (default /tmp/out).
#   bash docs/measure/tpu_chip.sh bench BATCHES REMATS [bench flags]   -> chip_<BATCHES>_<REMATS>.json
#   bash docs/measure/tpu_chip.sh bigvision BATCHES                     -> bigvision.json, verify.txt
set -euo pipefail
WHAT=${1:-bench}
BATCHES=${2:-32,64,128,256}
source "$(dirname "$0")/tpu_setup.sh"
if [[ $WHAT == bench ]]; then
  REMATS=${3:-none}
  json="$OUT/chip_${BATCHES//,/-}_${REMATS//,/-}.json"
  python3 -m shardkit.cli bench --chip --batches "$BATCHES" --remats "$REMATS" "${@:4}" --json \
    > "$json"
  python3 - "$json" <<'PY'
import json, sys
from shardkit.run.throughput import format_table
print(format_table(json.load(open(sys.argv[1]))))
PY
else
  python3 -m shardkit.cli verify --devices 1 2>&1 | tee "$OUT/verify.txt"
  python3 -m shardkit.cli verify --devices 1 --dtype bfloat16 --precision big_vision \
    --layers unrolled 2>&1 | tee "$OUT/verify_bf16.txt"
  python3 docs/measure/tpu_bigvision.py --batches "$BATCHES" --json "$OUT/bigvision.json"
fi
