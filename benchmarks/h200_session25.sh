#!/usr/bin/env bash
# Session 25 (2026-12-04): where the waited token's time goes on a fast disk. One step per
# device call (600 s at most). On the GPU host, after the bundle:
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session25.sh STEP
# (logs and JSON: benchmarks/results/h200/session25/; docs/results.md, fifteenth pass)
# eager (ran bff210b, each layer queued by `async_eval` as built): against d810834
#   (.ptx/before.tgz), alternating; the eager runs hung (rc 124). `diag` then took the
#   built-whole token's trace, and a run under faulthandler (a one-off hook, since removed)
#   the stacks in eager-stacks.txt: the MLX thread in `mx.array(...)` with the GIL held.
# gap (796bd3c, then 717907d): the gap from an answer to the next layer split into the
#   host's return to polling, its polling and, on the GPU's clock, its last empty look.
# lead (60b48df's kernel behind a one-off switch, since made the code): block 0 only
#   watches the mailbox, against as before, alternating.
# confirm (60b48df): default, warm-all and io; default again.
# regimes (ready, not run: no device time left): this code cold (default and io; the
#   1024-token prefill with io) and on the page cache twice, for every target's figure.
# next: session 24's `next` (readers 2 / 4 / 8, lookahead depth 2, device wait off with
#   warm-all and io), run with 2dbfeda.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  eager)
    paged c35
    for round in 1 2; do
      TAIL=1 old_bench before 120 eager-before-$round c35 "${warm[@]}" --warm --cases default
      TAIL=1 bench 120 eager-after-$round c35 "${warm[@]}" --warm --cases default
    done
    python3 benchmarks/read_path_summary.py "$OUT"/eager-*.json
    same "$OUT"/eager-*.json
    pack ;;
  trace)
    paged c35
    TAIL=1 old_bench before 120 eager-trace-before c35 "${warm[@]}" --warm --cases default --max-tokens 12 --trace "$OUT/timeline-before.json"
    TAIL=1 bench 120 eager-trace-after c35 "${warm[@]}" --warm --cases default --max-tokens 12 --trace "$OUT/timeline-after.json"
    python3 benchmarks/read_path_summary.py "$OUT"/eager-*.json
    same "$OUT"/eager-*.json
    gzip -f "$OUT"/timeline-*.json
    pack ;;
  gap)  # where the gap between an answer and the next layer goes: back_ms, poll_ms; a trace
    paged c35
    for round in 1 2; do
      TAIL=1 bench 120 gap-$round c35 "${warm[@]}" --warm --cases default
    done
    TAIL=1 bench 120 gap-trace c35 "${warm[@]}" --warm --cases default --max-tokens 12 --trace "$OUT/timeline-gap.json"
    python3 benchmarks/read_path_summary.py "$OUT"/gap-*.json
    gzip -f "$OUT"/timeline-*.json
    pack ;;
  lead)  # the wait kernel with block 0 only polling (MOESTREAM_LEAD_POLLS=1) against as is
    paged c35
    for round in 1 2; do
      TAIL=1 bench 120 lead-asis-$round c35 "${warm[@]}" --warm --cases default
      MOESTREAM_LEAD_POLLS=1 TAIL=1 bench 120 lead-polls-$round c35 "${warm[@]}" --warm --cases default
    done
    python3 benchmarks/read_path_summary.py "$OUT"/lead-*.json
    same "$OUT"/lead-*.json
    pack ;;
  confirm)  # the code as committed (block 0 only watches): default, warm-all and io; default again
    paged c35
    TAIL=1 bench 150 confirm-1 c35 "${warm[@]}" --warm --cases default,warm-all,io
    TAIL=1 bench 100 confirm-2 c35 "${warm[@]}" --warm --cases default
    python3 benchmarks/read_path_summary.py "$OUT"/confirm-*.json
    same "$OUT"/confirm-*.json
    pack ;;
  regimes)
    only c35; c35
    TAIL=1 bench 200 regimes-cold c35 "${cold[@]}" --cases default,io
    TAIL=1 bench 300 regimes-prefill c35 "${cold[@]}" --cases long-prompt,io
    paged c35
    for round in 1 2; do
      TAIL=1 bench 120 regimes-page-$round c35 "${warm[@]}" --warm --cases default,io
    done
    python3 benchmarks/read_path_summary.py "$OUT"/regimes-*.json
    pack ;;
  next)
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
if [ "$step" = diag ]; then  # the token built whole: its build and eval spans
  paged c35 >/dev/null
  TAIL=1 bench 120 diag-trace c35 "${warm[@]}" --warm --cases default --max-tokens 12 --trace "$OUT/timeline-whole.json"
  python3 benchmarks/read_path_summary.py "$OUT"/diag-trace.json
  gzip -f "$OUT"/timeline-*.json
fi
