#!/usr/bin/env bash
# For the next lease (written in session 21, 2026-12-04): the device wait with pulled
# installs (compute.device_wait, actors/device_wait.py), not measured on a GPU yet. One step
# per device call (600 s at most). On the GPU host, after the bundle:
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session22.sh STEP
# x4: benchmarks/pull_probe.py (a wait with pulled copies against a DMA of the same bytes),
#   then the 4-layer cut at 35B dims (20 s to write): the mailbox watched for a stall, then
#   the page cache with a 128 MiB pool, --device-wait auto against off (session 21: the
#   first version 0.51 against 47.61 tok/s, one token stalled for the 60 s timeout).
# fast: the full 35B in the page cache (the fast-disk target: 0.85 of min(io, warm-all)),
#   auto against off, with warm-all and io in the same invocation.
# cold: cold O_DIRECT, random and calibrated-gate routing, auto against off.
# check: tokens and logprobs of tiny models, auto against off (minutes of kernel compiles).
# debug: the probe then per-layer steps, the emulated wait, the real one (16 tokens each).
# stuck: a load left in the router's table over a second: its state and every thread's stack.
# (Run in session 22: docs/results.md, twelfth pass; benchmarks/results/h200/session22/.)
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  x4)
    timeout 90 python3 benchmarks/pull_probe.py 2>&1 | tail -3  # the pulled copies alone, seconds
    c35x4
    timeout 90 python3 benchmarks/device_wait_debug.py "$DATA/c35x4.qpack" --dump 60 --tokens 16 2>&1 | grep -v '^\s*$' | grep -v '\[info' | grep -v 'reader.py\|threading.py' | tail -30
    cat "$DATA"/c35x4.qpack/experts/* > /dev/null
    bench 150 x4-wait c35x4 --pool-mb 128 --max-tokens 32 --warm --cases default,io --device-wait auto
    bench 60 x4-off c35x4 --pool-mb 128 --max-tokens 32 --warm --cases default
    same "$OUT"/x4-wait.json "$OUT"/x4-off.json
    pack ;;
  fast)
    c35
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    bench 330 c35-fast c35 "${warm[@]}" --warm --cases default,warm-all,io --device-wait auto
    bench 120 c35-fast-off c35 "${warm[@]}" --warm --cases default
    same "$OUT"/c35-fast.json "$OUT"/c35-fast-off.json
    ptx_save
    pack ;;
  cold)
    c35
    bench 200 c35-random c35 "${cold[@]}" --cases default,io --device-wait auto
    bench 120 c35-random-off c35 "${cold[@]}" --cases default
    bench 150 c35-cal c35 "${cold[@]}" --routing calibrated-gate --cases default --device-wait auto
    bench 150 c35-cal-off c35 "${cold[@]}" --routing calibrated-gate --cases default,io
    same "$OUT"/c35-random.json "$OUT"/c35-random-off.json
    pack ;;
  debug)  # a stalled decode: the probe then per-layer steps, the emulated wait, the real one
    c35x4
    for a in "--drop" "--mode emulate" "--mode auto"; do
      echo "=== $a"
      timeout 60 python3 benchmarks/device_wait_debug.py "$DATA/c35x4.qpack" --dump 25 --tokens 8 $a 2>&1 | grep -v '^\s*$' |
        grep -v 'reader.py\|threading.py\|engine.open\|^Thread\|mlx_worker.py", line 64' | cut -c1-300 | tail -14
    done ;;
  stuck)  # a settle that timed out: the load it waited for, and every thread's stack
    c35x4
    timeout 60 python3 benchmarks/device_wait_debug.py "$DATA/c35x4.qpack" --dump 40 --tokens 16 2>&1 | grep -v '^\s*$' |
      grep -v 'engine.open\|queue_depth\|line 64 in _loop\|^Thread 0x' | cut -c1-400 | head -60 ;;
  check)
    timeout 550 python3 benchmarks/device_wait_check.py --dir "$DATA/wait" --families qwen3_5_moe 2>&1 | grep '^{' | head -1 | cut -c1-400 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
