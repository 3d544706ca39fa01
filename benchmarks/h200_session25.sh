#!/usr/bin/env bash
# Session 25 (2026-12-04): where the waited token's time goes on a fast disk. One step per
# device call (600 s at most). On the GPU host, after the bundle:
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session25.sh STEP
# (logs and JSON: benchmarks/results/h200/session25/; docs/results.md, fifteenth pass)
# Steps of the session that measured code since changed, run at their commits (check one
# out to repeat them): `eager` (bff210b: each layer queued by `async_eval` as built,
# against d810834 with `old_bench before`; it hung), the faulthandler stacks (a one-off
# hook), and `lead` (60b48df's kernel behind a one-off switch, against the kernel before).
# diag: a waited token's build and eval spans (12-token trace).
# gap: the gap from an answer to the next layer split into the host's return to polling,
#   its polling and, on the GPU's clock, its last empty look (ran at 796bd3c and 717907d).
# confirm (ran at 60b48df): default, warm-all and io; default again.
# regimes (ready, not run: no device time left): cold (default and io; the 1024-token
#   prefill with io) and the page cache twice, for every target's figure.
# next: session 24's `next` step (ran at 2dbfeda).
set -uo pipefail
if [ "$1" = next ]; then exec bash "$(dirname "$0")/h200_session24.sh" next; fi
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  diag)
    paged c35
    TAIL=1 bench 120 diag-trace c35 "${warm[@]}" --warm --cases default --max-tokens 12 --trace "$OUT/timeline-whole.json"
    python3 benchmarks/read_path_summary.py "$OUT"/diag-trace.json
    gzip -f "$OUT"/timeline-*.json ;;
  gap)
    paged c35
    for round in 1 2; do
      TAIL=1 bench 120 gap-$round c35 "${warm[@]}" --warm --cases default
    done
    TAIL=1 bench 120 gap-trace c35 "${warm[@]}" --warm --cases default --max-tokens 12 --trace "$OUT/timeline-gap.json"
    python3 benchmarks/read_path_summary.py "$OUT"/gap-*.json
    gzip -f "$OUT"/timeline-*.json
    pack ;;
  confirm)
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
  *) echo "unknown step $step: diag, gap, confirm, regimes or next" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
