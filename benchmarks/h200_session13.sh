#!/usr/bin/env bash
# Session 13's H200 runs (2026-12-03), one step per device call, each invocation with its
# own time limit. On the GPU host, after the bundle:
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session13.sh STEP
# The question of this session: the direct install (reader.device_copy = "direct": DMA
# from page-locked staging buffers into the pool's rows, actors/cuda_direct.py) against
# "load" (MLX's Load + scatter), side by side in one lease, on every issue-31 case.
# Containers live in $DATA on the device's disk. Results: $OUT/*.json and $OUT/STEP.log.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
tokens() {  # the default case's tokens of two runs: the same, bit for bit?
  python3 - "$OUT/$1.json" "$OUT/$2.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
ta = {r["name"]: r.get("token_ids") for r in a["results"] if r.get("token_ids")}
tb = {r["name"]: r.get("token_ids") for r in b["results"] if r.get("token_ids")}
print("tokens identical:", {k: ta[k] == tb.get(k) for k in ta if k in tb})
PY
}
step=$1
ptx_restore
{
case $step in
  setup)  # the 35B container; exactness of direct vs load on a tiny model meanwhile (on a
          # fresh machine its kernel compiles outlast 200 s: session 13 never saw it finish)
    nvidia-smi -L; df -h /tmp | tail -1
    (rm -rf "$DATA/c35.qpack"; $B bench-container --preset qwen3.6-35b-a3b -o "$DATA/c35.qpack" 2>&1 | tail -2) &
    timeout 200 python3 benchmarks/direct_exact_check.py --dir "$DATA/exact" 2>&1 | tail -1 | tee "$OUT/exact.json"
    wait; du -sh "$DATA/c35.qpack"
    timeout 60 python3 benchmarks/direct_copy_check.py "$DATA/c35.qpack" --blobs 64 2>&1 | tail -1 | tee "$OUT/copy-check.json" ;;
  random)  # random routing, cold: direct then load
    bench 170 c35-direct c35 "${cold[@]}" --cases default,io --device-copy direct
    bench 120 c35-load c35 "${cold[@]}" --cases default --device-copy load
    tokens c35-direct c35-load ;;
  fast)  # the page cache as a fast disk: direct then load
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    bench 100 c35-fast-direct c35 --pool-mb 1024 --warm --max-tokens 32 --cases default,io,warm-all --device-copy direct
    bench 80 c35-fast-load c35 --pool-mb 1024 --warm --max-tokens 32 --cases default --device-copy load ;;
  calibrated)  # realistic routing, cold: direct then load
    bench 150 c35-cal-direct c35 "${cold[@]}" --cases default,io --routing calibrated-gate --device-copy direct
    bench 120 c35-cal-load c35 "${cold[@]}" --cases default --routing calibrated-gate --device-copy load
    tokens c35-cal-direct c35-cal-load ;;
  prefill)  # a 1024-token prompt, cold, direct (the ceiling from its own io case)
    bench 200 c35-long-direct c35 "${cold[@]}" --cases long-prompt,io --device-copy direct ;;
  spec)  # issue 24: speculation with every expert pooled, and cold calibrated
    bench 260 c35-warm-spec c35 "${cold[@]}" --cases warm-all,resident,warm-spec-k2-a0.8,warm-spec-k3-a0.8,warm-spec-auto-a0.8
    bench 220 c35-cold-spec c35 "${cold[@]}" --cases default,spec-k2-a0.8,spec-k3-a0.8,spec-auto-a0.8 --routing calibrated-gate ;;
  final)  # the last lease's one call (kernels compile in the first bench, ~140 s)
    rm -rf "$DATA/c35.qpack"; $B bench-container --preset qwen3.6-35b-a3b -o "$DATA/c35.qpack" 2>&1 | tail -1
    bench 230 c35-direct c35 "${cold[@]}" --cases default,io --device-copy direct
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    bench 50 c35-fast-direct c35 --pool-mb 1024 --warm --max-tokens 32 --cases default,io --device-copy direct
    bench 40 c35-cal-direct c35 "${cold[@]}" --cases default,io --routing calibrated-gate --device-copy direct
    bench 30 c35-load c35 "${cold[@]}" --cases default --device-copy load
    tokens c35-direct c35-load ;;
  save)  # the kernel cache into $OUT for the next lease (h200_lib.sh)
    ptx_save ;;
  big)  # issue 31 / 25: the 80B at full dimensions, direct
    rm -rf "$DATA/c35.qpack"
    $B bench-container --preset qwen3-next-80b-a3b -o "$DATA/c80.qpack" 2>&1 | tail -2
    bench 330 c80 c80 "${cold[@]}" --cases default,io ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
