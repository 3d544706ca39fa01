#!/usr/bin/env bash
# Session 29 (2026-12-05): the first lease since session 26. The 1800 s of device time take
# the most important of sessions 26-28's unrun steps, compacted to three calls (the rest of
# h200_session26/27.sh stays for a later lease). On the GPU host, after the bundle (carry
# .gpu2 and .ptx: ptx-cache.tgz, prev27.tgz = `git archive 3c562ef`):
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session29.sh STEP
# (logs and JSON: bench-out/, kept in benchmarks/results/h200/session29/)
# ring (issue 31, the fast disk): 35B dims in the page cache, 1 GiB pool, 32 tokens: the
#   reader's threads against its io_uring, alternating, twice each; the ring at 8 in flight;
#   3c562ef (before the ring and the cheaper placement); every expert pooled (warm-all in 5
#   pairs against resident mlx-lm) and io, tokens checked; first reads beside busy Python
#   threads; a 12-token timeline of the ring.
# spec (issue 24): h200_session28.sh's spec without the code-before comparison.
# cold (issues 31, 24): the MTP container cold (O_DIRECT): default and io (random routing),
#   then calibrated-gate default, k=2 and auto at a = 0.8, and spec-auto.
# prefill (issue 31): the 1024-token prompt cold with io, on the same container.
# again: cold-spec and spec once more, then the warm speculative cases twice (the warm
#   figures of one 32-token run moved +-30 %: three or four runs of each).
# pairs (not run yet: written after the lease): the warm speculative cases, each now paired
#   with plain decode in its own engine (bench/warm_pairs.py `against_plain`), twice.
# The other steps ran on 2026-12-05 (benchmarks/results/h200/session29/, docs/results.md nineteenth pass).
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  ring)
    paged c35
    for round in 1 2; do
      TAIL=1 bench 100 ring-threads-$round c35 "${warm[@]}" --warm --cases default
      TAIL=1 bench 100 ring-uring-$round c35 "${warm[@]}" --warm --cases default --io uring
    done
    TAIL=1 bench 100 ring-uring-r8 c35 "${warm[@]}" --warm --cases default --io uring --readers 8
    TAIL=1 old_bench prev27 100 ring-prev c35 "${warm[@]}" --warm --cases default
    TAIL=1 bench 200 ring-pooled c35 "${warm[@]}" --warm --cases warm-all,io
    python3 benchmarks/read_path_summary.py "$OUT"/ring-*.json
    same "$OUT"/ring-pooled.json "$OUT"/ring-*.json
    timeout 60 python3 benchmarks/reads_under_gil.py "$DATA/c35.qpack" --reads 300 --depths 2,8 \
      --busy 0,1 2>&1 | grep -v "^20"
    TAIL=1 bench 80 ring-trace c35 "${warm[@]}" --warm --cases default --io uring --max-tokens 12 \
      --trace "$OUT/timeline-ring.json"
    gzip -f "$OUT"/timeline-*.json
    python3 benchmarks/waited_layers.py "$OUT/timeline-ring.json.gz" --token 6
    ptx_save
    pack ;;
  spec)
    only c35m; container c35m qwen3.6-35b-a3b --mtp; cat "$DATA"/c35m.qpack/experts/* > /dev/null
    TAIL=1 bench 300 spec-warm c35m "${warm[@]}" --cases warm-all,warm-spec-k2-a0.8,warm-spec-auto-a0.8,warm-spec-auto
    same "$OUT"/spec-warm.json
    pack ;;
  cold)
    only c35m; container c35m qwen3.6-35b-a3b --mtp
    TAIL=1 bench 200 cold-random c35m "${cold[@]}" --cases default,io
    TAIL=1 bench 300 cold-spec c35m "${cold[@]}" --routing calibrated-gate \
      --cases default,spec-k2-a0.8,spec-auto-a0.8,spec-auto
    python3 benchmarks/read_path_summary.py "$OUT"/cold-*.json
    same "$OUT"/cold-spec.json
    pack ;;
  prefill)
    only c35m; container c35m qwen3.6-35b-a3b --mtp
    TAIL=1 bench 420 prefill c35m "${cold[@]}" --cases long-prompt,io
    python3 benchmarks/read_path_summary.py "$OUT"/prefill.json
    pack ;;
  again)
    only c35m; container c35m qwen3.6-35b-a3b --mtp
    TAIL=1 bench 200 again-cold-spec c35m "${cold[@]}" --routing calibrated-gate \
      --cases default,spec-k2-a0.8,spec-auto-a0.8,spec-auto
    cat "$DATA"/c35m.qpack/experts/* > /dev/null
    TAIL=1 bench 250 again-spec-warm c35m "${warm[@]}" --cases warm-all,warm-spec-k2-a0.8,warm-spec-auto-a0.8,warm-spec-auto
    for i in 1 2; do
      TAIL=1 bench 160 third-spec-warm-$i c35m "${warm[@]}" --cases warm-all,warm-spec-auto,warm-spec-auto-a0.8,warm-spec-k2-a0.8
    done
    pack ;;
  pairs)
    only c35m; container c35m qwen3.6-35b-a3b --mtp; cat "$DATA"/c35m.qpack/experts/* > /dev/null
    for i in 1 2; do
      TAIL=1 bench 250 pairs-$i c35m "${warm[@]}" --cases warm-all,warm-spec-auto,warm-spec-auto-a0.8,warm-spec-k2-a0.8
    done
    pack ;;
  *) echo "unknown step $step: ring, spec, cold, prefill, again or pairs" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
