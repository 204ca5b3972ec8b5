# On a TPU host: one device's attention forward + backward (docs/strategies/kernels.md).
#   bash docs/measure/tpu_attention.sh            shardkit bench --attention --ring 4 (4k-32k):
#                                                 $OUT/tpu_attention.{json,txt} (the picture:
#                                                 attention_bench.plot on the JSON, anywhere)
#   bash docs/measure/tpu_attention.sh --blocks 512,1024,2048   the block-size sweep
#   bash docs/measure/tpu_attention.sh --crossover --tokens 256,512,1024,2048,4096
set -euo pipefail
source "$(dirname "$0")/tpu_setup.sh"
if [ $# -eq 0 ]; then
  python3 -m shardkit.cli bench --attention --ring 4 --json > "$OUT/tpu_attention.json"
  python3 -c "import json, sys; from shardkit.run import attention_bench as a; \
print(a.format_table(json.load(open(sys.argv[1]))))" "$OUT/tpu_attention.json" \
    | tee "$OUT/tpu_attention.txt"
else
  python3 docs/measure/tpu_attention.py "$@"
fi
