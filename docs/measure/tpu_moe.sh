#!/usr/bin/env bash
# On a TPU host (the `device` tool's v5e): the decoder, dense and mixture-of-experts, verified
# against its twin on one chip (full float32 matmul precision) and trained there.
#   bash docs/measure/tpu_moe.sh   -> $OUT/moe_verify.txt, $OUT/moe_train.txt
set -euo pipefail
source "$(dirname "$0")/tpu_setup.sh"
python3 -m shardkit.cli verify --model gpt --mesh data=1 2>&1 | grep -v "^WARNING" \
  | tee "$OUT/moe_verify.txt"
python3 -m shardkit.cli verify --model moe-gpt --mesh data=1 --capacity-factor 0.5 2>&1 \
  | grep -v "^WARNING" | tee -a "$OUT/moe_verify.txt"
start=$(date +%s.%N)
python3 -m shardkit.cli train --model moe-gpt --mesh data=1 --steps 300 --lr 1e-2 \
  2>&1 | grep -v "^WARNING" | tee "$OUT/moe_train.txt"
echo "wall $(echo "$(date +%s.%N) - $start" | bc) s (300 steps, compile included)" \
  | tee -a "$OUT/moe_train.txt"
