#!/usr/bin/env bash
# For the next lease (written in session 20, 2026-12-04): what session 20 changed and could
# not measure, one step per device call (a call runs 600 s at most). On the GPU host, after
# the bundle:
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session21.sh STEP
# cold: the 35B with stale predictions shelved: random routing with io and serial, then
#   calibrated-gate plain and passes (k=2, auto: the 1.4x target, met once in two runs).
# long: the 1024-token prefill with shelving (session 20's two runs predate it).
# uring: io_uring against the reader's threads on this host's disk and page cache
#   (benchmarks/uring_vs_threads.py; session 20 measured it on the VM only).
# fast: the page cache as a fast disk, with the bench's `MLX s` beside the stall, and the
#   same invocation's warm-all and io (the target: 0.85 of min(io ceiling, warm-all)).
# check: benchmarks/device_wait_check.py (session 21: decode tokens queued whole, the GPU
#   waiting for their reads); coldwait: that against --device-wait off, cold.
# c80: the 80B (44.85 GB: the disk holds nothing else), default and io.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  cold)
    c35
    bench 200 c35-random c35 "${cold[@]}" --cases default,serial,io
    bench 300 c35-cal c35 "${cold[@]}" --routing calibrated-gate --cases default,spec-k2-a0.8,spec-auto-a0.8
    same "$OUT"/c35-cal.json
    pack ;;
  long)
    c35
    bench 300 c35-long c35 "${cold[@]}" --cases long-prompt,io
    pack ;;
  uring)
    c35
    timeout 200 python3 benchmarks/uring_vs_threads.py "$DATA/c35.qpack" --reads 600 --rounds 3
    timeout 200 python3 benchmarks/uring_vs_threads.py "$DATA/c35.qpack" --reads 600 --rounds 3 --cached ;;
  check)  # exactness of the device wait on tiny models (tokens and logprobs, bit for bit)
    timeout 400 python3 benchmarks/device_wait_check.py --dir "$DATA/wait" 2>&1 | grep '^{' | head -2 | cut -c1-400 ;;
  debug)  # a 4-layer cut at 35B dims, the device wait watched (benchmarks/device_wait_debug.py)
    c35x4
    timeout 80 python3 benchmarks/device_wait_debug.py "$DATA/c35x4.qpack" --dump 60 --tokens 16 2>&1 | grep -v '^\s*$' | grep -v '\[info' | grep -v 'reader.py\|threading.py' | tail -40
    cat "$DATA"/c35x4.qpack/experts/* > /dev/null
    bench 150 x4-wait c35x4 --pool-mb 128 --max-tokens 32 --warm --cases default,io
    bench 60 x4-off c35x4 --pool-mb 128 --max-tokens 32 --warm --cases default --device-wait off
    same "$OUT"/x4-wait.json "$OUT"/x4-off.json
    pack ;;
  fast)  # the page cache as a fast disk: the device wait (default) against one sync per layer
    c35
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    bench 330 c35-fast c35 "${warm[@]}" --warm --cases default,warm-all,io
    bench 120 c35-fast-off c35 "${warm[@]}" --warm --cases default --device-wait off
    same "$OUT"/c35-fast.json "$OUT"/c35-fast-off.json
    ptx_save
    pack ;;
  coldwait)  # cold O_DIRECT: the device wait against one sync per layer, random and calibrated
    c35
    bench 200 c35-random c35 "${cold[@]}" --cases default,io
    bench 120 c35-random-off c35 "${cold[@]}" --cases default --device-wait off
    bench 150 c35-cal c35 "${cold[@]}" --routing calibrated-gate --cases default
    bench 150 c35-cal-off c35 "${cold[@]}" --routing calibrated-gate --cases default --device-wait off
    same "$OUT"/c35-random.json "$OUT"/c35-random-off.json
    pack ;;
  c80)
    only c80
    c80
    bench 300 c80 c80 "${cold[@]}" --max-tokens 16 --cases default,io
    pack ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
