#!/usr/bin/env bash
# Session 12's H200 runs (2026-12-02), one step per device call; each invocation has its
# own time limit so a slow one cannot eat the call. On the GPU host, after the bundle:
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session12.sh STEP
# Containers live in $DATA on the device's disk (35B 19.5 GB and 80B ~44 GB do not fit
# together). Results: $OUT/*.json and $OUT/STEP.log.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
{
case $step in
  setup)  # the 35B container, and the staging micro-benchmark beside it
    nvidia-smi -L; df -h /tmp | tail -1
    (rm -rf "$DATA/c35.qpack"; $B bench-container --preset qwen3.6-35b-a3b -o "$DATA/c35.qpack" 2>&1 | tail -2) &
    timeout 150 python3 benchmarks/managed_staging.py
    wait; du -sh "$DATA/c35.qpack" ;;
  disk)  # issue 31: random and calibrated routing (one io), the fast disk, extra guesses, prefill
    bench 250 c35-router-calibrated c35 "${cold[@]}" --cases default,serial,io --routing router,calibrated-gate
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    bench 75 c35-fast-load c35 --pool-mb 1024 --warm --max-tokens 24 --cases default,io
    bench 70 c35-calibrated-extra8 c35 "${cold[@]}" --cases default --routing calibrated-gate --prefetch-extra 8
    bench 100 c35-long-prompt c35 "${cold[@]}" --cases long-prompt,io ;;
  core)  # issue 31 again, split so each fits its limit (kernels are compiled by now)
    bench 200 c35-router c35 "${cold[@]}" --cases default,serial,io
    bench 130 c35-calibrated c35 "${cold[@]}" --cases default,io --routing calibrated-gate
    bench 200 c35-long-prompt c35 "${cold[@]}" --cases long-prompt ;;
  spec)  # issue 24: speculation with every expert pooled and cold calibrated; memory on the GPU
    bench 260 c35-warm-spec c35 "${cold[@]}" --cases warm-all,resident,warm-spec-k2-a0.8,warm-spec-k3-a0.8,warm-spec-auto-a0.8
    bench 200 c35-cold-spec c35 "${cold[@]}" --cases default,spec-k2-a0.8,spec-k3-a0.8,spec-auto-a0.8 --routing calibrated-gate ;;
  big)  # issue 31 / 25: the 80B at full dimensions
    rm -rf "$DATA/c35.qpack"
    $B bench-container --preset qwen3-next-80b-a3b -o "$DATA/c80.qpack" 2>&1 | tail -2
    bench 300 c80 c80 "${cold[@]}" --cases default,serial,io ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
