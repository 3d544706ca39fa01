#!/usr/bin/env bash
# Session 27 (2026-12-04): the reader's io_uring (`reader.io = "uring"`, actors/ring_reads.py)
# and a cheaper placement (eviction heaps set pinned entries aside; a layer's predicted reads
# submitted under one lock). Session 27 was lent no device: every step is ready, none was run.
# One step per device call (600 s at most). On the GPU host, after the bundle (carry .gpu2 and
# .ptx: ptx-cache.tgz, prev27.tgz = `git archive 3c562ef`, nohand.tgz = 8d519ca):
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session27.sh STEP
# (logs and JSON: bench-out/, to be kept in benchmarks/results/h200/session27/)
# ring: the page cache (the fast disk), 35B dims: first reads alone beside 0-2 threads of pure
#   Python (benchmarks/reads_under_gil.py: threads against the ring, GB/s and each read's
#   time to trio); then 1 GiB pool, 32 tokens: threads against the
#   ring, alternating, twice each, 2 reads in flight (decode's auto); the ring at 4 and 8 in
#   flight (the threads were no faster with more: session 26, each return into Python
#   queued for the GIL); the GIL hand-over on (off by default now: slower on the VM's page
#   cache); this code's threads against 3c562ef's (the placement, the hand-over on there);
#   then where the event loop waits (benchmarks/loop_sampler.py); every expert
#   pooled and io (tokens checked against it); a 12-token timeline of the ring.
# ringcold: O_DIRECT, cold page cache: threads and the ring, default and io (io at every depth).
# Then session 26's steps, still not run (benchmarks/h200_session26.sh: build, switch, check,
#   cold, prefill; `build` needs .ptx/nohand.tgz).
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  ring)
    paged c35
    timeout 120 python3 benchmarks/reads_under_gil.py "$DATA/c35.qpack" --reads 400 --depths 2,8,16 \
      --busy 0,1,2 2>&1 | grep -v "^20"
    for round in 1 2; do
      TAIL=1 bench 100 ring-threads-$round c35 "${warm[@]}" --warm --cases default
      TAIL=1 bench 100 ring-uring-$round c35 "${warm[@]}" --warm --cases default --io uring
    done
    for r in 4 8; do
      TAIL=1 bench 100 ring-uring-r$r c35 "${warm[@]}" --warm --cases default --io uring --readers $r
    done
    TAIL=1 bench 100 ring-handover c35 "${warm[@]}" --warm --cases default --gil-hand-over on
    TAIL=1 old_bench prev27 100 ring-prev c35 "${warm[@]}" --warm --cases default
    TAIL=1 bench 150 ring-pooled c35 "${warm[@]}" --warm --cases warm-all,io
    python3 benchmarks/read_path_summary.py "$OUT"/ring-*.json
    same "$OUT"/ring-pooled.json "$OUT"/ring-*.json
    TAIL=1 bench 100 ring-trace c35 "${warm[@]}" --warm --cases default --io uring --max-tokens 12 \
      --trace "$OUT/timeline-ring.json"
    gzip -f "$OUT"/timeline-*.json
    python3 benchmarks/waited_layers.py "$OUT/timeline-ring.json.gz" --token 6
    timeout 100 python3 benchmarks/loop_sampler.py "$DATA/c35.qpack" --tokens 24 2>&1 | grep -v "^20" | head -40
    pack ;;
  ringcold)
    only c35; c35
    TAIL=1 bench 250 ringcold-threads c35 "${cold[@]}" --cases default,io
    TAIL=1 bench 250 ringcold-uring c35 "${cold[@]}" --cases default --io uring
    python3 benchmarks/read_path_summary.py "$OUT"/ringcold-*.json
    same "$OUT"/ringcold-threads.json "$OUT"/ringcold-uring.json
    pack ;;
  *) echo "unknown step $step: ring or ringcold (and h200_session26.sh's build, switch, check, cold, prefill)" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
