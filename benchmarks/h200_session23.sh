#!/usr/bin/env bash
# For the next lease (written in session 22, 2026-12-04): what session 22 had no device time
# for, with its code (the device wait's grid, the settle's lost wakeup fixed). One step per
# device call (600 s at most). On the GPU host, after the bundle:
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session23.sh STEP
# cold: the 35B cold, random routing, default against serial and io in ONE invocation (the
#   ">= 2.5x serial" target, unmeasured since the settle fix), then calibrated with io.
# fast: the 35B on the page cache, --device-wait auto against off twice each, alternating
#   (session 22: 5.70 against 6.31, one pair), with warm-all and io.
# c80: the 80B, cold, 8 readers, default and io (last run in session 18: 0.963 of the ceiling).
# exact: greedy tokens and log-probabilities, streamed (1 GiB pool) against every expert
#   pooled, at the 35B's dimensions (benchmarks/pool_exact_check.py; session 22 saw bench's
#   sampled warm-all tokens part from the streamed run's: docs/results.md, twelfth pass).
# Added while session 23 ran them (docs/results.md, thirteenth pass): diag (exact's variants:
# run-ahead off, float32), contents (every slot's bytes against the file), banks (the
# gather_qmm index probe, exact and warm-all with the pool in banks), spec (warm-all against
# speculation k=2 at a=0.8).
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  cold)
    c35
    bench 300 c35-serial c35 "${cold[@]}" --cases default,serial,io
    bench 150 c35-cal c35 "${cold[@]}" --routing calibrated-gate --cases default,io
    pack ;;
  fast)
    c35
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    for round in 1 2; do
      bench 120 c35-fast-off-$round c35 "${warm[@]}" --warm --cases default
      bench 120 c35-fast-wait-$round c35 "${warm[@]}" --warm --cases default --device-wait auto
    done
    bench 200 c35-fast-refs c35 "${warm[@]}" --warm --cases warm-all,io
    same "$OUT"/c35-fast-*.json
    pack ;;
  exact)
    c35x4
    timeout 150 python3 benchmarks/pool_exact_check.py "$DATA/c35x4.qpack" --pool-mb 128 2>&1 | grep '^{' | tee "$OUT/exact-x4.json"
    c35
    timeout 300 python3 benchmarks/pool_exact_check.py "$DATA/c35.qpack" --pool-mb 1024 2>&1 | grep '^{' | tee "$OUT/exact-c35.json" ;;
  diag)  # session 23: exact's x4 parted only with the prompt chunked (pool 128 MB); at 1 GiB?
    c35x4
    timeout 100 python3 benchmarks/pool_exact_check.py "$DATA/c35x4.qpack" --pool-mb 1024 --variants pooled,pooled-stepped 2>&1 | grep '^{' | tee "$OUT/diag-x4.json"
    c35
    timeout 400 python3 benchmarks/pool_exact_check.py "$DATA/c35.qpack" --pool-mb 1024 --tokens 8 --variants pooled-stepped,streamed-f32,pooled-f32 2>&1 | grep '^{' | tee "$OUT/diag-c35.json" ;;
  contents)  # diag: at the 35B's dimensions the two part even in float32; whose bytes are wrong?
    only c35; c35
    timeout 400 python3 benchmarks/pool_contents_check.py "$DATA/c35.qpack" --pool-mb 1024 2>&1 | grep '^{' | tee "$OUT/contents-c35.json" ;;
  banks)  # contents: the bytes were right; gather_qmm indexes wrong past 2^31 elements. Banks:
    timeout 120 python3 benchmarks/gather_qmm_index_probe.py | tee "$OUT/gqmm-index.jsonl"
    only c35; c35
    timeout 300 python3 benchmarks/pool_exact_check.py "$DATA/c35.qpack" --pool-mb 1024 --tokens 16 --variants pooled 2>&1 | grep '^{' | tee "$OUT/exact-banks.json"
    bench 200 c35-warm c35 "${warm[@]}" --warm --cases warm-all ;;
  spec)  # speculation's warm target with the pooled forward now right (banks), one run
    c35
    bench 150 c35-warm-spec c35 --pool-mb 1024 --max-tokens 24 --warm --cases warm-all,warm-spec-k2-a0.8 ;;
  c80)
    only c80
    c80
    bench 400 c80 c80 "${cold[@]}" --readers 8 --max-tokens 16 --cases default,io
    pack ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
