#!/usr/bin/env bash
# Session 36 (2026-12-05, no device lent): the steps for the next lease, in order.
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session36.sh STEP
# n: issue 25's device memory with the bench forgetting its warm-up's prompt states
#    (session 35's `n`: the 1024-token prompt with the kernel on and off, cold decode twice).
# s: issue 24's warm speculation pairs (`auto` never hitting, a = 0.8), kernel on and off
#    (session 35's `s`).
# g: issue 31's warm-all gap: CUDA graph instantiations against updates of cached graphs per
#    decode token, engine against resident mlx-lm (benchmarks/gpu_kernels.py's `api` field:
#    MLX keys its graph cache by nodes and buffer dependencies; the resident model speeds up
#    pair after pair while the engine does not, docs/results.md nineteenth pass), then the
#    same with a larger graph cache (MLX_CUDA_GRAPH_CACHE_SIZE=4000) and with MLX's per-graph
#    input cap raised (MLX_MAX_MB_PER_BUFFER: MLX commits a graph once its kernels' inputs
#    pass 1000 MB on cc 9.0, and every MoE layer's gathers take a whole pool bank of ~3.5 GB
#    as input when every expert is pooled: ~one commit a layer; sessions 31-33 scripted this
#    and never reached it).
# l: the warm-all pairs (engine against resident mlx-lm) with the cap as shipped and raised,
#    alternating twice.
set -uo pipefail
here=$(dirname "$0")
step=$1
case $step in
  n|s) exec bash "$here/h200_session35.sh" "$step" ;;
esac
. "$here/h200_lib.sh"
ptx_restore
api() {  # api NAME [ENV...]: gpu_kernels.py's JSON, then its CUDA API calls per token
  local name=$1; shift
  echo "== $(date -u +%T) api $name: $*"
  env "$@" timeout 300 python3 benchmarks/gpu_kernels.py "$DATA/c35m.qpack" --tokens 16 2>&1 \
    | grep -v "Z \[" | tail -1 > "$OUT/api-$name.json"
  python3 - "$OUT/api-$name.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for side in ("engine", "resident"):
    s = r[side]
    print(side, {k: v for k, v in s.items() if k.startswith("per_token")})
    for name, (calls, us) in sorted(s.get("api", {}).items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {name:40s} {calls:8.2f} calls {us:9.1f} us a token")
PY
}
{
case $step in
  g)
    c35m
    api default
    api cache4000 MLX_CUDA_GRAPH_CACHE_SIZE=4000
    api mb MLX_MAX_MB_PER_BUFFER=1000000
    ptx_save ;;
  l)
    c35m
    for i in $(seq "${PAIRS:-2}"); do  # PAIRS=1 where the lease is short
      TAIL=1 bench 150 l-shipped-$i c35m "${warm[@]}" --cases warm-all
      MLX_MAX_MB_PER_BUFFER=1000000 TAIL=1 bench 150 l-mb-$i c35m "${warm[@]}" --cases warm-all
    done
    pairs_table "$OUT"/l-*.json
    for f in "$OUT"/l-*.json; do pairs_over "$f"; done ;;
  *) echo "unknown step $step: n, s, g or l" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
