#!/usr/bin/env bash
# Session 15's H200 runs (2026-12-03), one step per device call, each bench with its own
# time limit. On the GPU host, after the bundle:
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session15.sh STEP
# The questions: speculation's speed-ups on the GPU (issue 24, never measured there); the
# 1024-token prefill and the 80B with the direct install; on the page cache (a fast disk)
# and with calibrated routing, whether more reads in flight (--readers 8) or predictions
# further ahead (lookahead depth 2-3, --prefetch-extra) close the gap (issue 31).
# Containers live in $DATA on the device's disk. Results: $OUT/*.json and $OUT/STEP.log.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  warmspec)  # the 35B container, then speculation with every expert pooled (pays the compiles)
    nvidia-smi -L; df -h /tmp | tail -1
    rm -rf "$DATA/c35.qpack"; $B bench-container --preset qwen3.6-35b-a3b -o "$DATA/c35.qpack" 2>&1 | tail -1
    bench 330 c35-warm-spec c35 "${cold[@]}" --cases warm-all,warm-spec-k2-a0.8,warm-spec-k3-a0.8,warm-spec-auto-a0.8,resident
    same "$OUT/c35-warm-spec.json" ;;
  coldspec)  # speculation, cold, calibrated routing; then the 1024-token prefill
    bench 230 c35-cold-spec c35 "${cold[@]}" --cases default,spec-k2-a0.8,spec-k3-a0.8,spec-auto-a0.8 --routing calibrated-gate
    same "$OUT/c35-cold-spec.json"
    bench 230 c35-long c35 "${cold[@]}" --cases long-prompt,io ;;
  tune)  # the read path's knobs: page cache (fast disk), calibrated, random
    bench 60 c35-cal c35 "${cold[@]}" --cases default,io --routing calibrated-gate
    bench 40 c35-cal-x2 c35 "${cold[@]}" --cases default --routing calibrated-gate --prefetch-extra 2
    bench 40 c35-cal-la2 c35 "${cold[@]}" --cases default --routing calibrated-gate --strategy lookahead --depth 2
    bench 50 c35-random c35 "${cold[@]}" --cases default,io
    same "$OUT/c35-random.json" "$OUT/c35-cold-spec.json"
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    fast=(--pool-mb 1024 --warm --max-tokens 32)
    bench 50 c35-fast c35 "${fast[@]}" --cases default,io
    bench 30 c35-fast-r8 c35 "${fast[@]}" --cases default --readers 8
    bench 30 c35-fast-la2 c35 "${fast[@]}" --cases default --readers 8 --strategy lookahead --depth 2
    bench 30 c35-fast-la3 c35 "${fast[@]}" --cases default --readers 8 --strategy lookahead --depth 3
    same "$OUT"/c35-fast*.json
    ptx_save ;;
  big)  # issue 31 / 25: the 80B at full dimensions
    rm -rf "$DATA/c35.qpack"
    $B bench-container --preset qwen3-next-80b-a3b -o "$DATA/c80.qpack" 2>&1 | tail -1
    bench 330 c80 c80 "${cold[@]}" --cases default,io ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
