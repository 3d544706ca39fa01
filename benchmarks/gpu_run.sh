#!/usr/bin/env bash
# The GPU host's part of the benchmarks. Containers cannot travel (tens of GB): they
# are written here, on the device's disk, then benched, then deleted.
#   bash benchmarks/gpu_run.sh write PRESET TAG     # bench container -> $DATA/TAG.qpack
#   bash benchmarks/gpu_run.sh bench TAG [flags]    # moestream bench -> $OUT/TAG.json
#   bash benchmarks/gpu_run.sh sweep TAG [flags]    # benchmarks/sweep.py -> $OUT/TAG-sweep.json
# A sweep point is a process of its own (~50 s at these sizes, plus the first one's kernel
# compiles): one 10-minute device call holds ~10 points; split with --only if needed.
# Needs PYTHONPATH=/tmp/site:$PWD (see ../shared/tools/gpu-bundle) and $OUT.
set -uo pipefail
DATA=${DATA:-$PWD/bench-data}
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$DATA" "$OUT"
export PYTHONUNBUFFERED=1
# MLX compiles its CUDA kernels on first use; cases share the cache on this machine.
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$DATA/ptx-cache}
B="python3 benchmarks/moestream_bench.py"
mode=$1; shift
if [ "$mode" = write ]; then
  preset=$1; tag=$2
  {
    echo "== $(date -u) write $preset on $(hostname)"; df -h "$DATA" | tail -1; free -g | head -2
    rm -rf "$DATA/$tag.qpack"
    $B --log-level info bench-container --preset "$preset" -o "$DATA/$tag.qpack"
    du -sh "$DATA/$tag.qpack"
  } 2>&1 | tee -a "$OUT/$tag-write.log"
elif [ "$mode" = sweep ]; then
  tag=$1; shift
  {
    echo "== $(date -u) sweep $tag"; nvidia-smi -L
    python3 benchmarks/sweep.py "$DATA/$tag.qpack" -o "$OUT/$tag-sweep.json" --o-direct \
      --max-tokens 12 --case-timeout 300 "$@"
    echo "== sweep exit $? $(date -u)"
  } 2>&1 | tee -a "$OUT/$tag-sweep.log"
else
  tag=$1; shift
  {
    echo "== $(date -u) bench $tag"; nvidia-smi -L
    $B bench "$DATA/$tag.qpack" --pool-mb 1024 --o-direct --json "$OUT/$tag.json" \
      --trace "$OUT/$tag-trace.json" "$@"
    echo "== bench exit $? $(date -u)"
  } 2>&1 | tee -a "$OUT/$tag.log"
fi
