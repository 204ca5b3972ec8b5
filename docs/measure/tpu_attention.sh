# On a TPU host: one device's attention forward + backward, shardkit's kernels against splash
# (docs/strategies/kernels.md). Results: $OUT/tpu_attention.json.
set -euo pipefail
source "$(dirname "$0")/tpu_setup.sh"
python3 docs/measure/tpu_attention.py "$@"
