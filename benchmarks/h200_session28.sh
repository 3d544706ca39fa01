#!/usr/bin/env bash
# Session 28 (2026-12-05): `auto` asks its drafter at plain steps (shadow drafts,
# actors/speculative/policy.py) and spaces its probes by their measured loss. Session 28 was
# lent no device: the step is ready, not run. On the GPU host, after the bundle (carry .gpu2
# and .ptx: ptx-cache.tgz, prev28.tgz = `git archive 31150aa`, the code before):
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session28.sh spec|speccold
# (logs and JSON: bench-out/, to be kept in benchmarks/results/h200/session28/)
# spec: 35B dims with the MTP head (`bench-container --mtp`, c35m), 1 GiB pool. Every expert
#   pooled: warm-all (against resident mlx-lm in 5 alternating pairs now), k=2 and `auto` at
#   a = 0.8, and `spec-auto` (the head, random weights: it accepts nothing, the case where
#   `auto` must back off, >= 0.97x plain); then the code before (31150aa) on warm
#   `spec-auto`, for the same lease's comparison (~7 min with the container's writing).
# speccold: the same container cold (O_DIRECT), calibrated-gate routing: default, k=2,
#   `auto` at a = 0.8 and `spec-auto` (~5 min).
# Before this, the steps of h200_session27.sh (ring, ringcold) and h200_session26.sh (cold,
# prefill, build, switch, check) are still to run.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  spec)
    only c35m; container c35m qwen3.6-35b-a3b --mtp; cat "$DATA"/c35m.qpack/experts/* > /dev/null
    TAIL=1 bench 200 spec-warm c35m "${warm[@]}" --cases warm-all,warm-spec-k2-a0.8,warm-spec-auto-a0.8,warm-spec-auto
    TAIL=1 old_bench prev28 150 spec-warm-prev c35m "${warm[@]}" --cases warm-all,warm-spec-auto
    same "$OUT"/spec-warm.json
    pack ;;
  speccold)
    only c35m; container c35m qwen3.6-35b-a3b --mtp
    TAIL=1 bench 300 spec-cold c35m "${cold[@]}" --routing calibrated-gate \
      --cases default,spec-k2-a0.8,spec-auto-a0.8,spec-auto
    same "$OUT"/spec-cold.json
    pack ;;
  *) echo "unknown step $step: spec, speccold (and h200_session27.sh's ring, ringcold; h200_session26.sh's build, switch, check, cold, prefill)" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
