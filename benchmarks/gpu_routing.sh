#!/usr/bin/env bash
# Calibrated routing end to end on the GPU host (issue 18): the 35B-dims 10-layer bench
# container, a 1 GiB pool, O_DIRECT, 4 readers; default and serial on calibrated routing
# with the emulated gate and on the container's own (random) routers, then default with
# next-gate on the real routers under calibrated routing (its honest accuracy).
#   bash benchmarks/gpu_routing.sh main      # ~6 min: container (~20 s) + 5 cases
#   bash benchmarks/gpu_routing.sh extra     # ~5 min: LRU at 1 GiB; 256 MiB (40-layer share)
# Needs PYTHONPATH=/tmp/site:$PWD (see ../shared/tools/gpu-bundle) and $OUT.
set -uo pipefail
DATA=${DATA:-$PWD/bench-data}
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$DATA" "$OUT"
export PYTHONUNBUFFERED=1
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$DATA/ptx-cache}  # kernels compiled once, shared by cases
mode=${1:-main}
LAYERS=${LAYERS:-10}  # fewer (>= 4) and TOKENS=4 for a quick check on a CPU
B="python3 benchmarks/moestream_bench.py"
C="$DATA/q35-$LAYERS.qpack"
common=(--o-direct --readers 4 --max-tokens "${TOKENS:-32}" --case-timeout 200)
{
  echo "== $(date -u) routing $mode on $(hostname)"; nvidia-smi -L 2>/dev/null
  if [ ! -f "$C/manifest.json" ]; then
    $B --log-level info bench-container --preset qwen3.6-35b-a3b --max-layers "$LAYERS" -o "$C" || exit 1
  fi
  if [ "$mode" = main ]; then
    $B bench "$C" --pool-mb 1024 "${common[@]}" --cases default,serial \
      --routing calibrated-gate,router --json "$OUT/routing-1g.json"
    $B bench "$C" --pool-mb 1024 "${common[@]}" --cases default \
      --routing calibrated --json "$OUT/routing-1g-real-gate.json"
  else
    $B bench "$C" --pool-mb 1024 "${common[@]}" --cases default --eviction lru \
      --routing calibrated-gate --json "$OUT/routing-1g-lru.json"
    $B bench "$C" --pool-mb 256 "${common[@]}" --cases default,serial \
      --routing calibrated-gate,router --json "$OUT/routing-256m.json"
  fi
  echo "== exit $? $(date -u)"
} 2>&1 | tee -a "$OUT/routing-$mode.log"
