#!/usr/bin/env bash
# The planner's rankings in docs/target.md: ViT-B/16, L/16 and H/14 (bf16) on v5e-8, -64 and
# -256, compiled here by libtpu's TPU compiler (no chip). Each compiled plan is cached under
# ~/.cache/shardkit/plans, so a second run only re-ranks.
#   bash docs/measure/plan_topologies.sh [KEEP]      (default 2: compile until 2 plans fit)
set -uo pipefail  # a slice nothing fits (exit 1) still writes its table
keep=${1:-2}
out=docs/measure/results/plan
mkdir -p "$out"
for topo in v5e:2x4 v5e:8x8 v5e:16x16; do
  chips=$(( $(echo "${topo#*:}" | tr x '*') ))
  for variant in B/16 L/16 H/14; do
    batch=$(( chips * 32 ))
    name="$out/${topo/:/_}_${variant/\//_}"
    echo "== $topo $variant batch $batch" >&2
    shardkit plan --target "$topo" --variant "$variant" --dtype bfloat16 --batch "$batch" \
      --keep "$keep" --markdown > "$name.md"
    shardkit plan --target "$topo" --variant "$variant" --dtype bfloat16 --batch "$batch" \
      --keep "$keep" --json > "$name.json"
  done
done
