#!/usr/bin/env bash
# For the next lease (written in session 19, 2026-12-04): what session 19 changed or could
# not settle, one step per device call. On the GPU host, after the bundle:
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session20.sh STEP
# spec [N]: session 19's pass warm-ups and `auto` pricing, one round per call (one run each so far): every
#   expert pooled (k=2, auto at a=0.8), then cold with calibrated-gate routing (the issue's
#   cold target, 1.4x; session 19: 1.18x).
# long [N]: the 35B 1024-token prefill, one run per call (target 0.85 of one pass; 0.70-0.854 so far).
# fast: the page cache as a fast disk, next-gate against lookahead depth 2 (0.17-0.28 so far).
# gate: the emulated gate that sees each token (session 20) against session 19's, whose
#   guesses for a pass's positions were one set: cold calibrated-gate plain and passes with
#   each code (the old one unpacked from .ptx/s19-code.tgz), then warm-all against resident.
# shelf: stale predictions shelved against the code before them (.ptx/gate-code.tgz), cold
#   calibrated-gate plain and passes, then random routing.
# again: the shelf step's calibrated passes once more (k=2, 3, auto), then the page cache.
# g120: gpt-oss-120b's first 20 of 36 layers (36.9 GB: the disk holds nothing else).
# Containers live in $DATA on the device's disk (64 GB: one big container at a time).
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  spec)
    c35
    i=${2:-1}  # one round per call (a call may run 600 s at most)
    bench 150 c35-warm-spec$i c35 "${warm[@]}" --cases warm-all,warm-spec-k2-a0.8,warm-spec-auto-a0.8
    bench 300 c35-cold-spec$i c35 "${cold[@]}" --cases default,spec-k2-a0.8,spec-k3-a0.8,spec-auto-a0.8 --routing calibrated-gate
    same "$OUT"/c35-cold-spec$i.json
    pack ;;
  gate)
    c35
    cal=("${cold[@]}" --routing calibrated-gate)
    old_bench s19-code 200 c35-gate-s19 c35 "${cal[@]}" --cases default,spec-k2-a0.8
    bench 300 c35-gate c35 "${cal[@]}" --cases default,spec-k2-a0.8,spec-auto-a0.8
    bench 150 c35-warm c35 "${warm[@]}" --cases warm-all,resident
    same "$OUT"/c35-gate*.json
    pack ;;
  shelf)  # stale predictions shelved (session 20) against the code before, same lease
    c35
    cal=("${cold[@]}" --routing calibrated-gate)
    old_bench gate-code 200 c35-cal-before c35 "${cal[@]}" --cases default,spec-k2-a0.8
    bench 250 c35-cal-shelf c35 "${cal[@]}" --cases default,spec-k2-a0.8,spec-auto-a0.8
    old_bench gate-code 100 c35-rand-before c35 "${cold[@]}" --cases default
    bench 150 c35-rand-shelf c35 "${cold[@]}" --cases default,io
    same "$OUT"/c35-cal-*.json
    same "$OUT"/c35-rand-*.json
    pack ;;
  again)  # the shelf step's passes once more, then the page cache as a fast disk
    c35
    bench 220 c35-cal-again c35 "${cold[@]}" --routing calibrated-gate --cases default,spec-k2-a0.8,spec-k3-a0.8,spec-auto-a0.8
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    bench 90 c35-fast c35 "${warm[@]}" --warm --cases default
    same "$OUT"/c35-cal-again.json
    pack ;;
  long)
    c35
    i=${2:-1}
    bench 300 c35-long$i c35 "${cold[@]}" --cases long-prompt,io
    pack ;;
  fast)
    c35
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    bench 90 c35-fast c35 "${warm[@]}" --warm --cases default
    bench 90 c35-fast-la2 c35 "${warm[@]}" --warm --cases default --strategy lookahead --depth 2
    same "$OUT"/c35-fast*.json
    pack ;;
  g120)
    only g120
    [ -f "$DATA/g120.qpack/manifest.json" ] || $B bench-container --preset gpt-oss-120b --max-layers 20 -o "$DATA/g120.qpack" 2>&1 | tail -1
    bench 480 g120 g120 "${cold[@]}" --cases default,io,warm-all,resident
    ptx_save; pack ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
