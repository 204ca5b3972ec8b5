#!/usr/bin/env bash
# On a TPU host: batch 32 probes for per-layer parameter buffers and the attention's projections
# (docs/performance.md, "batch 32"). Usage: bash docs/measure/tpu_layers.sh; results in $OUT.
set -euo pipefail
source "$(dirname "$0")/tpu_setup.sh"
V=loop,remat=none,res=bf16,attn=flax
python3 docs/measure/tpu_bigvision.py --batches 32 | tee "$OUT/bigvision.txt"
python3 docs/measure/tpu_vit_variants.py --batch 32 $V $V,layers=list $V,layers=list,qkv=fused \
  $V,layers=list,heads=major 2>&1 | grep -v "^WARNING" | tee "$OUT/variants_b32.txt"
python3 docs/measure/tpu_profile.py --batch 32 --out "$OUT" $V,layers=list 2>&1 \
  | grep -v "^WARNING" | tee "$OUT/profile_b32.txt"
