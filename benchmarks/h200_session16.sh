#!/usr/bin/env bash
# Session 16's H200 runs (2026-12-03/04), one step per device call. On the GPU host, after
# the bundle:  export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session16.sh STEP
# trace: where a streamed token's time goes at full 35B dimensions, as Perfetto timelines
#   of the default case on the page cache (a fast disk) and cold with calibrated routing.
# Containers live in $DATA on the device's disk. Results: $OUT/*.json and $OUT/STEP.log.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  trace)
    nvidia-smi -L; df -h /tmp | tail -1
    [ -f "$DATA/c35.qpack/manifest.json" ] || $B bench-container --preset qwen3.6-35b-a3b -o "$DATA/c35.qpack" 2>&1 | tail -1
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    fast=(--pool-mb 1024 --warm --max-tokens 16)
    bench 330 c35-fast-trace c35 "${fast[@]}" --cases default,io --trace "$OUT/fast-trace.json"
    bench 60 c35-cal-trace c35 "${cold[@]}" --max-tokens 16 --cases default --routing calibrated-gate --trace "$OUT/cal-trace.json"
    ptx_save ;;
  land)  # landing (reads installed by their disk thread) on and off, side by side
    [ -f "$DATA/c35.qpack/manifest.json" ] || $B bench-container --preset qwen3.6-35b-a3b -o "$DATA/c35.qpack" 2>&1 | tail -1
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    fast=(--pool-mb 1024 --warm --max-tokens 32)
    bench 90 c35-fast-land c35 "${fast[@]}" --cases default,io --trace "$OUT/fast-land-trace.json"
    bench 60 c35-fast-noland c35 "${fast[@]}" --cases default --land off
    bench 90 c35-random-land c35 "${cold[@]}" --cases default,io
    bench 90 c35-cal-land c35 "${cold[@]}" --cases default,io --routing calibrated-gate
    bench 120 c35-long-land c35 "${cold[@]}" --cases long-prompt
    same "$OUT"/c35-fast-land.json "$OUT"/c35-fast-noland.json
    same "$OUT"/c35-random-land.json "$OUT"/c35-cal-land.json ;;
  stripes)  # landing with one lock per stripe of slots; the 1024-token prefill (JIT included)
    [ -f "$DATA/c35.qpack/manifest.json" ] || $B bench-container --preset qwen3.6-35b-a3b -o "$DATA/c35.qpack" 2>&1 | tail -1
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    fast=(--pool-mb 1024 --warm --max-tokens 32)
    bench 90 c35-fast-stripes c35 "${fast[@]}" --cases default,io --trace "$OUT/fast-stripes-trace.json"
    bench 60 c35-fast-noland2 c35 "${fast[@]}" --cases default --land off
    same "$OUT"/c35-fast-stripes.json "$OUT"/c35-fast-noland2.json
    bench 330 c35-long-land c35 "${cold[@]}" --cases long-prompt,io ;;
  auto)  # reader.land = auto picks off on the page cache, on from the cloud disk; x serial
    [ -f "$DATA/c35.qpack/manifest.json" ] || $B bench-container --preset qwen3.6-35b-a3b -o "$DATA/c35.qpack" 2>&1 | tail -1
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    bench 60 c35-fast-auto c35 --pool-mb 1024 --warm --max-tokens 32 --cases default
    bench 200 c35-random-auto c35 "${cold[@]}" --cases default,serial,io
    same "$OUT"/c35-random-auto.json ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
