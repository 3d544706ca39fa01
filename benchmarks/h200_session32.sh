#!/usr/bin/env bash
# Session 32 (2026-12-05): the container of session 31 (c35m: the 35B with its MTP layer).
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session32.sh STEP
# g: CUDA graph commits per decode token, engine (every expert pooled) against resident
#    mlx-lm (benchmarks/graph_commits.py), by default and with the element cap out of the
#    way (MLX_MAX_MB_PER_BUFFER; h200_session31.sh `limits` says why): the hypothesis
#    checked without timing noise, before the timed pairs.
# g2: the same with the element cap raised, and host CPU per token on each side
#    (benchmarks/host_cpu_token.py: session 31's warm-all engine spent 0.81 s of MLX-thread
#    CPU in a 0.91 s decode, so the token is host-bound), by default and raised.
# l: the timed pairs, default against the raised limits, alternating, and the page cache.
# p: warm speculation pairs (issue 24's `auto` after its new-text trial rule), then host CPU
#    per token. kv: kv_bits on CUDA (issue 25: the start-time probe refuses or the case runs).
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
commits() {  # commits NAME [ENV...]
  local name=$1; shift
  echo "== $(date -u +%T) commits $name: $*"
  env "$@" timeout 400 python3 benchmarks/graph_commits.py "$DATA/c35m.qpack" "$DATA/dots-$name" 4 2>&1 | tail -1 \
    | tee "$OUT/commits-$name.json"
  local rc=${PIPESTATUS[0]}
  echo "dot files $(ls "$DATA/dots-$name" | wc -l), $(du -sh "$DATA/dots-$name" | cut -f1)"
  echo "== $(date -u +%T) commits $name rc $rc"
}
{
case $step in
  g)
    paged c35m
    commits default
    ptx_save ;;
  g2)
    c35m
    commits mb MLX_MAX_MB_PER_BUFFER=1000000
    hostcpu default
    hostcpu mb MLX_MAX_MB_PER_BUFFER=1000000 ;;
  l)
    paged c35m
    for i in 1 2; do
      TAIL=1 bench 150 limits-default-$i c35m "${warm[@]}" --warm --cases warm-all
      (export "${@:2}"; TAIL=1 bench 150 limits-raised-$i c35m "${warm[@]}" --warm --cases warm-all)
    done
    TAIL=1 bench 60 limits-fast-default c35m "${warm[@]}" --warm --cases default
    (export "${@:2}"; TAIL=1 bench 60 limits-fast-raised c35m "${warm[@]}" --warm --cases default)
    same "$OUT"/limits-*.json
    python3 benchmarks/read_path_summary.py "$OUT"/limits-fast-*.json
    pairs_table "$OUT"/limits-*.json
    pack ;;
  p)
    c35m
    TAIL=1 bench 250 pairs c35m "${warm[@]}" --cases warm-all,warm-spec-auto,warm-spec-auto-a0.8
    python3 - "$OUT"/pairs.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(r["name"], round(r["decode_tok_s"], 2), {k: v for k, v in r.items() if "over" in k or k.startswith("paired")})
PY
    hostcpu default ;;
  h)  # host CPU per token on a 10-layer cut (a lease too short for the full container)
    container c35x10 qwen3.6-35b-a3b --max-layers 10
    C=c35x10 hostcpu cut ;;
  kv) kv_step ;;
  *) echo "unknown step $step: g, g2, l, p, h or kv" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
