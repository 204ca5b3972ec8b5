#!/usr/bin/env bash
# On a TPU host: the per-op profile (tpu_profile.py) and the variant timings (tpu_vit_variants.py)
# behind docs/performance.md. Usage: bash docs/measure/tpu_profile.sh; results in $OUT.
set -euo pipefail
source "$(dirname "$0")/tpu_setup.sh"
python3 docs/measure/tpu_profile.py --batch 32 --out "$OUT" \
  bigvision loop,remat=none,res=bf16,scores=bf16 2>&1 | grep -v "^WARNING" | tee "$OUT/profile.txt"
for b in 128 32; do  # why a large batch is slow: results/tpu_v5e_profile_b128.txt
  python3 docs/measure/tpu_profile.py --batch $b --out "$OUT" bigvision \
    loop,remat=none,res=bf16,attn=flax 2>&1 | grep -v "^WARNING" | tee "$OUT/profile_b$b.txt"
done
python3 docs/measure/tpu_bigvision.py --batches 32 | tee "$OUT/bigvision.txt"
python3 docs/measure/tpu_vit_variants.py --batch 32 \
  loop,remat=none,res=bf16,attn=flax \
  loop,remat=none,res=bf16,attn=flax,layers=list \
  loop,remat=none,res=bf16,attn=flax,layers=list,norm \
  remat=dots,res=bf16,attn=flax \
  2>&1 | grep -v "^WARNING" | tee "$OUT/variants_b32.txt"
V=loop,remat=none,res=bf16,attn=flax  # results/tpu_v5e_accum.txt: attention chunks, micro-batches
python3 docs/measure/tpu_vit_variants.py --batch 128 $V,chunk=32 $V,chunk=32,chunks=unrolled \
  $V,chunk=16 $V,accum=4 | tee "$OUT/accum.txt"
python3 docs/measure/tpu_vit_variants.py --batch 256 $V $V,accum=8 $V,accum=8,layers=list \
  | tee -a "$OUT/accum.txt"
python3 docs/measure/tpu_vit_variants.py --batch 64 $V,accum=2 | tee -a "$OUT/accum.txt"
python3 docs/measure/tpu_vit_variants.py --batch 32 $V,accum=2 $V,accum=2,layers=list $V,accum=4 \
  | tee -a "$OUT/accum.txt"
