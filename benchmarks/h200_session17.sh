#!/usr/bin/env bash
# Session 17's H200 runs (2026-12-04), one step per device call. On the GPU host, after
# the bundle:  export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session17.sh STEP
# look: Perfetto timelines of the 1024-token prefill (cold, O_DIRECT) and of decode on the
#   page cache (a fast disk), full 35B dimensions, 1 GiB pool.
# Containers live in $DATA on the device's disk. Results: $OUT/*.json and $OUT/STEP.log.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
c35() {
  [ -f "$DATA/c35.qpack/manifest.json" ] || $B bench-container --preset qwen3.6-35b-a3b -o "$DATA/c35.qpack" 2>&1 | tail -1
}
{
case $step in
  look)
    nvidia-smi -L; df -h /tmp | tail -1; c35
    bench 330 c35-long-trace c35 "${cold[@]}" --cases long-prompt,io --trace-case long-prompt --trace "$OUT/long-trace.json"
    ptx_save
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    bench 90 c35-fast-trace c35 --pool-mb 1024 --warm --max-tokens 16 --cases default --trace "$OUT/fast-trace.json" ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
