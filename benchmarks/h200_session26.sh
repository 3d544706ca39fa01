#!/usr/bin/env bash
# Session 26 (2026-12-04): a waited token's reads listed for the GPU as they end (issue 31,
# the fast disk). One step per device call (600 s at most). On the GPU host, after the bundle:
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session26.sh STEP
# (logs and JSON: benchmarks/results/h200/session26/; docs/results.md, sixteenth pass)
# early: the page cache, this code (4bf3b41; 3c8d481: per-row constants of the wait made once; the
#   asker answers before the prefetch placed after its reply)
#   against e229638 (a waited token's reads listed as each ends: .ptx/early.tgz) and
#   5d017c2 (before both: .ptx/prev.tgz), `git archive`s, alternating, twice each; then
#   every expert pooled and io (the tokens checked against it), a 12-token timeline and the
#   build's profile (benchmarks/build_profile.py).
# again (644cb11: the seq read by the lead only, io at every depth, a demand that evicts
#   none of its own experts): this code against 5d017c2 twice each, 4 and 8 readers, pooled
#   and io, a timeline.
# Ready, not run (the device was lent no more this session):
# check: the device wait's exactness on tiny models (benchmarks/device_wait_check.py).
# cold: default and io, O_DIRECT, cold page cache; prefill: the 1024-token prompt with io
#   (both with io at every depth: the ratios of the cold figures against the disk's best).
# build: the page cache, the waited token's build timed (benchmarks/build_profile.py, timers
#   now: early's cProfile saw every thread on Python 3.12); this code (the GIL handed to the
#   disk threads after a batch of submits) against the code before it (.ptx/nohand.tgz, a
#   `git archive` of 8d519ca), twice each; pooled and io. Also worth running cold.
# switch: the page cache with the GIL's switch interval 0.2 / 0.1 / 0.05 ms while readers
#   run (`bench --switch-interval-ms`): a disk thread needs the GIL between two preads, and
#   the queue before a pread was 0.85-1.0 ms against the pread's 0.4 (session 26); then
#   4 and 8 readers at 0.05 ms.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
pooled_and_trace() {  # pooled_and_trace PREFIX: every expert pooled and io, the runs' summary
  # and tokens against it, a 12-token timeline and its layers
  local p=$1
  TAIL=1 bench 150 $p-pooled c35 "${warm[@]}" --warm --cases warm-all,io
  python3 benchmarks/read_path_summary.py "$OUT"/$p-*.json
  same "$OUT"/$p-pooled.json "$OUT"/$p-*.json
  TAIL=1 bench 100 $p-trace c35 "${warm[@]}" --warm --cases default --max-tokens 12 --trace "$OUT/timeline-$p.json"
  gzip -f "$OUT"/timeline-*.json
  python3 benchmarks/waited_layers.py "$OUT/timeline-$p.json.gz" --token 6
}
{
case $step in
  early)
    paged c35
    for round in 1 2; do
      TAIL=1 old_bench prev 100 early-prev-$round c35 "${warm[@]}" --warm --cases default
      TAIL=1 old_bench early 100 early-pull-$round c35 "${warm[@]}" --warm --cases default
      TAIL=1 bench 100 early-now-$round c35 "${warm[@]}" --warm --cases default
    done
    pooled_and_trace early
    timeout 90 python3 benchmarks/build_profile.py "$DATA/c35.qpack" --tokens 24 2>&1 | grep -v "^20" | tail -5
    pack ;;
  again)
    paged c35
    for round in 1 2; do
      TAIL=1 old_bench prev 100 again-prev-$round c35 "${warm[@]}" --warm --cases default
      TAIL=1 bench 100 again-now-$round c35 "${warm[@]}" --warm --cases default
    done
    for r in 4 8; do
      TAIL=1 bench 100 again-r$r c35 "${warm[@]}" --warm --cases default --readers $r
    done
    pooled_and_trace again
    pack ;;
  build)
    paged c35
    timeout 90 python3 benchmarks/build_profile.py "$DATA/c35.qpack" --tokens 24 2>&1 | grep -v "^20" | tail -5
    for round in 1 2; do
      TAIL=1 old_bench nohand 100 build-nohand-$round c35 "${warm[@]}" --warm --cases default
      TAIL=1 bench 100 build-now-$round c35 "${warm[@]}" --warm --cases default
    done
    TAIL=1 bench 150 build-pooled c35 "${warm[@]}" --warm --cases warm-all,io
    python3 benchmarks/read_path_summary.py "$OUT"/build-*.json
    same "$OUT"/build-pooled.json "$OUT"/build-*.json
    pack ;;
  switch)
    paged c35
    for round in 1 2; do
      for ms in 0.2 0.1 0.05; do
        TAIL=1 bench 100 switch-$ms-$round c35 "${warm[@]}" --warm --cases default --switch-interval-ms $ms
      done
    done
    for r in 4 8; do  # more threads, each needing the GIL less long
      TAIL=1 bench 100 switch-0.05-r$r c35 "${warm[@]}" --warm --cases default --switch-interval-ms 0.05 --readers $r
    done
    python3 benchmarks/read_path_summary.py "$OUT"/switch-*.json
    pack ;;
  check)
    timeout 300 python3 benchmarks/device_wait_check.py --dir "$DATA/wait" --families qwen3_5_moe 2>&1 | grep '^{' | head -1 | cut -c1-600 ;;
  cold)
    only c35; c35
    TAIL=1 bench 250 cold c35 "${cold[@]}" --cases default,io
    python3 benchmarks/read_path_summary.py "$OUT"/cold.json
    pack ;;
  prefill)
    only c35; c35
    TAIL=1 bench 400 prefill c35 "${cold[@]}" --cases long-prompt,io
    python3 benchmarks/read_path_summary.py "$OUT"/prefill.json
    pack ;;
  *) echo "unknown step $step: early, again, build, switch, check, cold or prefill" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
