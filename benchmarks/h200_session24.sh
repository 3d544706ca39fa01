#!/usr/bin/env bash
# For the next lease (written in session 23, 2026-12-04): what session 23 had no device time
# for, with its code (pool banks; bench's tokens_as_default). One step per device call (600 s
# at most). On the GPU host, after the bundle:
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session24.sh STEP
# exact80: the 80B streamed (1 GiB pool) against every expert pooled (24,576 slots: 12 banks
#   of 2,048), greedy tokens and log-probabilities (session 23 checked the 35B: identical).
# contents: the 35B's pool after installs through MLX's scatter (reader.device_copy = load,
#   the fallback where the direct DMA probe fails): every slot's bytes against the file, as
#   session 23 checked the direct path (a scatter past 2^31 elements is unchecked on CUDA).
# prefill: the 35B's 1024-token prompt, cold, with io (session 22: 0.79 of one pass; 20: 1.05).
# fast: the 35B on the page cache, default and warm-all and io in one invocation, and
#   default with --device-wait auto, twice (session 23: 4.07 tok/s, 0.31 of the io
#   ceiling; readers auto = 2 beat 4 and 8); the read path's thread_cpu_s says which host
#   thread is busy.
# gap: device-wait auto's answer and gap per layer (2, 4 readers) and a 12-token trace.
# poll: device-wait auto on the page cache, polling with sleeps (this code) against the
#   busy checkpoints before (`git archive` of 3ee9bf1 in .ptx/before.tgz), twice; stepped on
#   the page cache; cold O_DIRECT stepped against waited.
# confirm: device_wait = auto (the default now) against off on the page cache, twice; cold
#   with auto (declined there: the disk reads < 4 GB/s).
# next (not run in session 24: no device time left): the waited token with 2 / 4 / 8 readers
#   and lookahead depth 2 now that the polling gives the GIL back (the decode depth is
#   capped at 2 from stepping's measurements: actors/queue_depth.py), against stepping.
# sweep: device-wait auto with 2 / 4 / 8 readers, 8 with lookahead depth 2, stepping with 8.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  exact80)
    only c80
    c80
    timeout 400 python3 benchmarks/pool_exact_check.py "$DATA/c80.qpack" --pool-mb 1024 --tokens 12 --variants pooled 2>&1 | grep '^{' | tee "$OUT/exact-c80.json" ;;
  contents)
    only c35; c35
    timeout 500 python3 benchmarks/pool_contents_check.py "$DATA/c35.qpack" --pool-mb 1024 --device-copy load 2>&1 | grep '^{' | tee "$OUT/contents-load.json" ;;
  prefill)
    only c35; c35
    bench 400 c35-long c35 "${cold[@]}" --cases long-prompt,io
    pack ;;
  fast)
    paged c35
    for round in 1 2; do
      bench 200 c35-fast-$round c35 "${warm[@]}" --warm --cases default,warm-all,io
      bench 150 c35-fast-wait-$round c35 "${warm[@]}" --warm --cases default --device-wait auto
    done
    pack ;;
  sweep)  # the waited token's readers and prediction depth on the page cache
    paged c35
    for r in 2 4 8; do
      TAIL=1 bench 120 wait-r$r c35 "${warm[@]}" --warm --cases default --device-wait auto --readers $r
    done
    TAIL=1 bench 120 wait-r8-la2 c35 "${warm[@]}" --warm --cases default --device-wait auto --readers 8 --strategy lookahead --depth 2
    TAIL=1 bench 120 step-r8 c35 "${warm[@]}" --warm --cases default --readers 8
    python3 benchmarks/read_path_summary.py "$OUT"/*.json
    pack ;;
  gap)  # where the waited token's time goes: answer, gap (GPU + polling), with a trace
    paged c35
    for r in 2 4; do
      TAIL=1 bench 120 gap-r$r c35 "${warm[@]}" --warm --cases default --device-wait auto --readers $r
    done
    TAIL=1 bench 120 gap-trace c35 "${warm[@]}" --warm --cases default --device-wait auto --readers 4 \
      --max-tokens 12 --trace "$OUT/timeline-gap.json"
    python3 benchmarks/read_path_summary.py "$OUT"/gap-r*.json
    gzip -f "$OUT/timeline-gap.json"
    pack ;;
  poll)  # the event loop's polling sleeps (this commit) against busy checkpoints (.ptx/before.tgz)
    paged c35
    for round in 1 2; do
      TAIL=1 old_bench before 120 poll-before-$round c35 "${warm[@]}" --warm --cases default --device-wait auto
      TAIL=1 bench 120 poll-after-$round c35 "${warm[@]}" --warm --cases default --device-wait auto
    done
    TAIL=1 bench 120 poll-stepped c35 "${warm[@]}" --warm --cases default
    TAIL=1 bench 200 poll-cold-stepped c35 "${cold[@]}" --cases default
    TAIL=1 bench 200 poll-cold-wait c35 "${cold[@]}" --cases default --device-wait auto
    python3 benchmarks/read_path_summary.py "$OUT"/poll-*.json
    pack ;;
  confirm)  # device_wait = auto, the new default: on for the page cache, declined cold
    paged c35
    for round in 1 2; do
      TAIL=1 bench 120 confirm-auto-$round c35 "${warm[@]}" --warm --cases default
      TAIL=1 bench 120 confirm-off-$round c35 "${warm[@]}" --warm --cases default --device-wait off
    done
    TAIL=1 bench 200 confirm-cold-auto c35 "${cold[@]}" --cases default,io
    python3 benchmarks/read_path_summary.py "$OUT"/confirm-*.json
    pack ;;
  next)  # for the next lease: readers and prediction depth with the new polling (auto: waited)
    paged c35
    for r in 2 4 8; do
      TAIL=1 bench 120 next-r$r c35 "${warm[@]}" --warm --cases default --readers $r
    done
    TAIL=1 bench 120 next-r4-la2 c35 "${warm[@]}" --warm --cases default --readers 4 --strategy lookahead --depth 2
    TAIL=1 bench 120 next-off c35 "${warm[@]}" --warm --cases default,warm-all,io --device-wait off
    python3 benchmarks/read_path_summary.py "$OUT"/next-*.json
    pack ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
