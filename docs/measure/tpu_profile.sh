#!/usr/bin/env bash
# On a TPU host: the per-op profile (tpu_profile.py) and the variant timings (tpu_vit_variants.py)
# behind docs/performance.md. Usage: bash docs/measure/tpu_profile.sh; results in $OUT.
set -euo pipefail
source "$(dirname "$0")/tpu_setup.sh"
python3 docs/measure/tpu_profile.py --batch 32 --out "$OUT" \
  bigvision loop,remat=none,res=bf16,scores=bf16 2>&1 | grep -v "^WARNING" | tee "$OUT/profile.txt"
python3 docs/measure/tpu_bigvision.py --batches 32 | tee "$OUT/bigvision.txt"
python3 docs/measure/tpu_vit_variants.py --batch 32 \
  loop,remat=none,res=bf16,attn=flax \
  loop,remat=none,res=bf16,attn=flax,layers=list \
  loop,remat=none,res=bf16,attn=flax,layers=list,norm \
  remat=dots,res=bf16,attn=flax \
  2>&1 | grep -v "^WARNING" | tee "$OUT/variants_b32.txt"
