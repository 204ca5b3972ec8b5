#!/usr/bin/env bash
# docs/target.md's bench --target tables: ViT-B/16 (bf16, batch 256) on v5e:2x4, shardkit's
# step against XLA auto's for the issue's six plans, with libtpu's default flags and with
# MaxText's (--tpu-flags maxtext); compiled here by libtpu (no chip).
#   bash docs/measure/bench_target.sh
set -uo pipefail
out=docs/measure/results/bench_target
mkdir -p "$out"
for flags in ${FLAGS:-default maxtext}; do
  shardkit bench --target v5e:2x4 --tpu-flags "$flags" --variant B/16 --dtype bfloat16 \
    --batch 256 --strategies "DP,FSDP,DP×TP,ring,Ulysses,PP 1F1B×DP×TP" --json \
    > "$out/v5e_2x4_B_16_$flags.json"
  python3 - "$out/v5e_2x4_B_16_$flags.json" > "$out/v5e_2x4_B_16_$flags.md" <<'PY'
import json, sys
from shardkit.run.target_bench import format_table
print(format_table(json.load(open(sys.argv[1])), markdown=True))
PY
done
# The same DP row with the gradient all-reduce in bf16 (--grad-sync bfloat16), as auto sends it.
shardkit bench --target v5e:2x4 --variant B/16 --dtype bfloat16 --batch 256 --strategies DP \
  --grad-sync bfloat16 --json > "$out/v5e_2x4_B_16_grad_sync_bf16.json"
python3 - "$out/v5e_2x4_B_16_grad_sync_bf16.json" > "$out/v5e_2x4_B_16_grad_sync_bf16.md" <<'PY'
import json, sys
from shardkit.run.target_bench import format_table
print(format_table(json.load(open(sys.argv[1])), markdown=True))
PY
# The six plans with --overlap wherever a plan allows it (docs/target.md, overlap.md).
shardkit bench --target v5e:2x4 --variant B/16 --dtype bfloat16 --batch 256 \
  --strategies "DP,FSDP,DP×TP,ring,Ulysses,PP 1F1B×DP×TP" --overlap --json \
  > "$out/v5e_2x4_B_16_overlap.json"
python3 - "$out/v5e_2x4_B_16_overlap.json" > "$out/v5e_2x4_B_16_overlap.md" <<'PY'
import json, sys
from shardkit.run.target_bench import format_table
print(format_table(json.load(open(sys.argv[1])), markdown=True))
PY
