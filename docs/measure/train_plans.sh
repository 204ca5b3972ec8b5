#!/usr/bin/env bash
# Trains the default model on digits under each plan (no compilation cache) and prints the final
# test accuracy, the wall time of the whole command and the train-step compile seconds.
#   bash docs/measure/train_plans.sh        # ~3 minutes on 2 cores
set -euo pipefail
SHARDKIT=${SHARDKIT:-.venv/bin/shardkit}
out=$(mktemp -d)
while read -r plan; do
  start=$(date +%s.%N)
  $SHARDKIT train $plan --cache none --out "$out/run" --force 2>/dev/null >/dev/null
  end=$(date +%s.%N)
  python3 - "$out/run" "$plan" "$start" "$end" <<'PY'
import json, sys
run, plan, start, end = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
last = [json.loads(l) for l in open(f"{run}/metrics.jsonl")][-1]
compile_s = json.load(open(f"{run}/config.json"))["compile_s"]["train_step"]
print(f"| `{plan or '(default: --mesh data=8)'}` | {last['test_accuracy']:.4f} | {end - start:.1f} s | {compile_s:.1f} s |")
PY
done <<'PLANS'

--mesh data=2,seq=2,model=2 --sp ring
--mesh data=8 --fsdp
--mesh data=4,model=2
--mesh data=2,seq=4 --sp ulysses
--mesh data=2,seq=4 --sp usp --ulysses 2
--mesh data=2,model=4 --sp megatron --remat
--mesh data=2,seq=2,model=2 --sp ring --fsdp --remat
PLANS
