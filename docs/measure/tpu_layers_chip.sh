#!/usr/bin/env bash
# On a TPU host: bench --chip with per-layer params (--layers list) at batch 32 whole and at
# 64-256 in micro-batches of 32, big_vision at 32 beside it (docs/performance.md). Results in
# $OUT. About 8 minutes on a v5e.
#   bash docs/measure/tpu_layers_chip.sh verify   -> verify_list.txt (about 1.5 minutes)
set -euo pipefail
source "$(dirname "$0")/tpu_setup.sh"
if [[ "${1:-}" == verify ]]; then
  python3 -m shardkit.cli verify --devices 1 --layers list 2>&1 | tee "$OUT/verify_list.txt"
  exit
fi
bash docs/measure/tpu_chip.sh bench 32 none --layers list --precision big_vision
python3 docs/measure/tpu_bigvision.py --batches 32 --json "$OUT/bigvision.json"
bash docs/measure/tpu_chip.sh bench 64,128,256 none --layers list --precision big_vision \
  --micro-batch 32
