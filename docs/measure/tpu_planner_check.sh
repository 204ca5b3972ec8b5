#!/usr/bin/env bash
# On a TPU host (the `device` tool's v5e): one chip's train-step throughput for the planner's
# chip table (run/planner.py CHIPS) and its check: ViT-B/16, L/16 and H/14 in bf16 with the
# layers as a scan (what `shardkit plan` compiles by default) and unrolled, shardkit and
# vit_ref side by side (bench --chip). Results land in $OUT (default /tmp/out).
#   bash docs/measure/tpu_planner_check.sh
set -euo pipefail
source "$(dirname "$0")/tpu_setup.sh"
run() {  # variant batches remats layers
  local name="$OUT/planner_${1//\//_}_$4.json"
  python3 -m shardkit.cli bench --chip --variant "$1" --dtype bfloat16 --batches "$2" \
    --remats "$3" --layers "$4" --steps 5 --warmup 2 --json > "$name"
  python3 - "$name" <<'PY'
import json, sys
from shardkit.run.throughput import format_table
print(format_table(json.load(open(sys.argv[1]))))
PY
}
run B/16 32 none scan
run B/16 32 none unrolled
run L/16 32 none,dots scan
run H/14 8,32 dots,full scan
