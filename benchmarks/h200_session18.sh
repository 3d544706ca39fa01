#!/usr/bin/env bash
# Session 18's H200 runs (2026-12-04), one step per device call. On the GPU host, after
# the bundle:  export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session18.sh STEP
# a: the 1024-token prefill with the paired last token (its first run compiles the kernels,
#   ~140 s on a fresh lease); b: cold random decode beside serial, warm-all beside resident
#   and `auto` speculation, the page cache; c80: the 80B. JSON as one archive per step.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  a)
    nvidia-smi -L; df -h /tmp | tail -1; c35
    bench 360 c35-long c35 "${cold[@]}" --cases long-prompt,io
    ptx_save; pack ;;
  b)
    c35
    bench 200 c35-warm c35 --pool-mb 1024 --max-tokens 32 --cases warm-all,resident,warm-spec-auto-a0.8,warm-spec-k2-a0.8 --trace-case warm-all --trace "$OUT/warm-trace.json"
    bench 170 c35-random c35 "${cold[@]}" --cases default,serial,io
    pack ;;
  f)  # the page cache as a fast disk: next-gate (one layer ahead) against lookahead 2 and 3
    c35
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    fast=(--pool-mb 1024 --warm --max-tokens 32 --cases default)
    bench 60 c35-fast c35 "${fast[@]}"
    bench 60 c35-fast-la2 c35 "${fast[@]}" --strategy lookahead --depth 2
    bench 60 c35-fast-la3 c35 "${fast[@]}" --strategy lookahead --depth 3
    same "$OUT"/c35-fast*.json
    pack ;;
  w)  # warm-all beside resident, twice (the lease is noisy)
    c35
    bench 120 c35-warm1 c35 --pool-mb 1024 --max-tokens 32 --cases warm-all,resident
    bench 120 c35-warm2 c35 --pool-mb 1024 --max-tokens 32 --cases warm-all,resident
    pack ;;
  c80)
    [ -f "$DATA/c80.qpack/manifest.json" ] || $B bench-container --preset qwen3-next-80b-a3b -o "$DATA/c80.qpack" 2>&1 | tail -1
    bench 400 c80 c80 "${cold[@]}" --max-tokens 16 --cases default,long-prompt,io
    pack ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
