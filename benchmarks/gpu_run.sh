#!/usr/bin/env bash
# One model on the GPU host: write its bench container, bench it, delete it.
#   bash benchmarks/gpu_run.sh PRESET TAG [extra bench flags...]
# Needs PYTHONPATH=/tmp/site:$PWD (see ../shared/tools/gpu-bundle) and $OUT.
# Containers cannot travel (tens of GB): they are written here, on the device's disk.
set -uo pipefail
preset=$1; tag=$2; shift 2
DATA=${DATA:-$PWD/bench-data}
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$DATA" "$OUT"
export PYTHONUNBUFFERED=1
B="python3 benchmarks/moestream_bench.py"
log="$OUT/$tag.log"
{
  echo "== $(date -u) $preset on $(hostname)"; nvidia-smi -L; df -h "$DATA" | tail -1; free -g | head -2
  rm -rf "$DATA/$tag.qpack"
  $B --log-level info bench-container --preset "$preset" -o "$DATA/$tag.qpack"
  du -sh "$DATA/$tag.qpack"
  $B bench "$DATA/$tag.qpack" --pool-mb 1024 --o-direct --json "$OUT/$tag.json" \
     --trace "$OUT/$tag-trace.json" --case-timeout 240 "$@"
  echo "== bench exit $? $(date -u)"
} 2>&1 | tee -a "$log"
