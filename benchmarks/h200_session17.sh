#!/usr/bin/env bash
# Session 17's H200 runs (2026-12-04), one step per device call. On the GPU host, after
# the bundle:  export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session17.sh STEP
# look: Perfetto timelines of the 1024-token prefill (cold, O_DIRECT) and of decode on the
#   page cache (a fast disk), full 35B dimensions, 1 GiB pool.
# next: what this session built after its device time ran out, for the next lease: the
#   paired last prompt token and the bulk lane (readers_prefill in the JSON), `auto`
#   speculation's plain price, warm-all beside resident (JSON as one archive); next80: the 80B.
# Containers live in $DATA on the device's disk. Results: $OUT/*.json and $OUT/STEP.log.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  look)
    nvidia-smi -L; df -h /tmp | tail -1; c35
    bench 330 c35-long-trace c35 "${cold[@]}" --cases long-prompt,io --trace-case long-prompt --trace "$OUT/long-trace.json"
    ptx_save
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    bench 90 c35-fast-trace c35 --pool-mb 1024 --warm --max-tokens 16 --cases default --trace "$OUT/fast-trace.json" ;;
  mid)  # landing on the staging threads: prefill, cold random, the page cache on/off; warm traces
    c35
    bench 200 c35-long-stagers c35 "${cold[@]}" --cases long-prompt,io
    bench 90 c35-random-stagers c35 "${cold[@]}" --cases default,io
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    fast=(--pool-mb 1024 --warm --max-tokens 32 --cases default)
    bench 60 c35-fast-landon c35 "${fast[@]}" --land on
    bench 60 c35-fast-landoff c35 "${fast[@]}" --land off
    same "$OUT"/c35-fast-landon.json "$OUT"/c35-fast-landoff.json
    bench 150 c35-warm c35 --pool-mb 1024 --max-tokens 32 --cases warm-all,resident --trace-case warm-all --trace "$OUT/warm-trace.json"
    bench 120 c35-warm-spec c35 --pool-mb 1024 --max-tokens 32 --cases warm-all,warm-spec-k2-a0.8 --trace-case warm-spec-k2-a0.8 --trace "$OUT/spec-trace.json"
    ptx_save ;;
  final)  # side by side: prefill with/without the bulk lane, cold decode, the page cache on/off, warm-all
    c35
    bench 110 c35-long-bulk c35 "${cold[@]}" --cases long-prompt,io
    bench 80 c35-long-r2 c35 "${cold[@]}" --cases long-prompt --readers 2
    bench 150 c35-random c35 "${cold[@]}" --cases default,serial,io
    bench 60 c35-cal c35 "${cold[@]}" --cases default --routing calibrated-gate
    same "$OUT"/c35-random.json "$OUT"/c35-cal.json
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    fast=(--pool-mb 1024 --warm --max-tokens 32 --cases default)
    for i in 1 2; do
      bench 40 c35-fast-on$i c35 "${fast[@]}" --land on
      bench 40 c35-fast-off$i c35 "${fast[@]}" --land off
    done
    TAIL=4 same "$OUT"/c35-fast-*.json
    bench 120 c35-warm c35 --pool-mb 1024 --max-tokens 32 --cases warm-all,resident
    # At most 8 files come back from a lease: the JSON as one archive.
    tar czf "$OUT/final-json.tgz" -C "$OUT" $(cd "$OUT" && ls *.json) && rm -f "$OUT"/*.json ;;
  probe)  # the fixed depth probe (buffers faulted first, threads timed from a barrier):
    # what readers=auto and the prefill's bulk lane pick, cold and on the page cache
    c35
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    bench 40 c35-fast-probe c35 --pool-mb 1024 --warm --max-tokens 32 --cases default
    bench 40 c35-fast-r2 c35 --pool-mb 1024 --warm --max-tokens 32 --cases default --readers 2
    bench 75 c35-long-probe c35 "${cold[@]}" --cases long-prompt,io ;;
  next)
    c35
    bench 110 c35-long-next c35 "${cold[@]}" --cases long-prompt,io
    bench 150 c35-random-next c35 "${cold[@]}" --cases default,serial,io
    bench 150 c35-warm-next c35 --pool-mb 1024 --max-tokens 32 --cases warm-all,resident,warm-spec-auto-a0.8,warm-spec-k2-a0.8
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    bench 40 c35-fast-next c35 --pool-mb 1024 --warm --max-tokens 32 --cases default
    tar czf "$OUT/next-json.tgz" -C "$OUT" $(cd "$OUT" && ls *.json) && rm -f "$OUT"/*.json ;;
  next80)  # the 80B (one call of its own: its container takes ~65 s)
    [ -f "$DATA/c80.qpack/manifest.json" ] || $B bench-container --preset qwen3-next-80b-a3b -o "$DATA/c80.qpack" 2>&1 | tail -1
    bench 300 c80-next c80 "${cold[@]}" --max-tokens 16 --cases default,long-prompt,io ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
