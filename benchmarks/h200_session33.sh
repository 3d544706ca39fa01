#!/usr/bin/env bash
# Session 33 (2026-12-05): the container of sessions 31-32 (c35m: the 35B with its MTP layer).
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session33.sh STEP
# k: issue 31's warm-all gap split on the GPU: every CUDA kernel per decode token, engine
#    (every expert pooled) against resident mlx-lm (benchmarks/gpu_kernels.py: kernel count,
#    summed kernel time, GPU busy, wall), then host CPU per token on the full depth
#    (host_cpu_token.py --dtype model, which session 32's lease did not reach).
# p: issue 24's `auto` with a head that never hits, after its new-text trial rule, and the
#    warm speculation pairs; kv: issue 25's kv_bits on CUDA (refused at start, or it runs).
# l: the timed warm-all pairs, MLX's graph limits as shipped against raised.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
kernels() {  # kernels NAME [ENV...]
  local name=$1; shift
  echo "== $(date -u +%T) kernels $name: $*"
  env "$@" timeout 300 python3 benchmarks/gpu_kernels.py "$DATA/${C:-c35m}.qpack" --tokens 16 2>&1 \
    | grep -v "Z \[" | tail -4 | tee "$OUT/kernels-$name.json"
  echo "== $(date -u +%T) kernels $name rc ${PIPESTATUS[0]}"
}
{
case $step in
  k)
    python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.is_available())'
    c35m
    kernels default
    hostcpu default
    ptx_save ;;
  p)
    c35m
    TAIL=1 bench 250 pairs c35m "${warm[@]}" --cases warm-all,warm-spec-auto,warm-spec-auto-a0.8
    pairs_table "$OUT"/pairs.json
    python3 - "$OUT"/pairs.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(r["name"], {k: v for k, v in r.items() if "over" in k})
PY
    ;;
  kv) kv_step ;;
  l)
    paged c35m
    for i in 1 2; do
      TAIL=1 bench 150 limits-default-$i c35m "${warm[@]}" --warm --cases warm-all
      (export "${@:2}"; TAIL=1 bench 150 limits-raised-$i c35m "${warm[@]}" --warm --cases warm-all)
    done
    pairs_table "$OUT"/limits-*.json ;;
  ab)  # warm-all, this code against the code before the kernel census's fixes (.ptx/old33.tgz:
    # `git archive 74785e0`), one run each in one lease
    paged c35m
    TAIL=1 bench 170 ab-new c35m "${warm[@]}" --warm --cases warm-all
    TAIL=1 old_bench old33 170 ab-old c35m "${warm[@]}" --warm --cases warm-all
    pairs_table "$OUT"/ab-*.json ;;
  da)  # warm-all with a second step queued (compute.decode_ahead, the default since session 33's
    # lease ended) against one, alternating, twice; then the GPU's busy time per token with it
    paged c35m
    for i in 1 2; do
      TAIL=1 bench 150 da-auto-$i c35m "${warm[@]}" --warm --cases warm-all
      TAIL=1 bench 150 da-off-$i c35m "${warm[@]}" --warm --cases warm-all --decode-ahead off
    done
    pairs_table "$OUT"/da-*.json
    kernels ahead ;;
  *) echo "unknown step $step: k, p, kv, l, ab or da" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
