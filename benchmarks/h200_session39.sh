#!/usr/bin/env bash
# Session 39 (2026-12-06): issue 25's host target measured against its own baseline, and
# issue 31's warm-all host profile.
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session39.sh STEP
# The issue's host target is "RSS <= the process's RSS before its first weight + 0.6 GB"
# ("~1.1 GB of the host side is the CUDA runtime before any weight"); the bench had marked
# the process before MLX brought the CUDA context up (394 MiB), so the runtime's mappings
# counted as the engine's. The engine now marks RSS once the runtime is up (`runtime_up`,
# the memory table's "runtime" column) and the bench reports each case's peak above it,
# mlx-lm's resident model (every weight on the device, no pool) beside it.
# m: the runtime's own growth (benchmarks/runtime_rss.py), the container, the cold default
#    case and resident mlx-lm twice (each its own process), then the page cache's default
#    case (waited tokens: their device peak).
# p: the engine's MLX thread profiled against resident mlx-lm's host CPU a token.
# s: cold speculation, the pass's predicted union cut to its best 12 / 16 (--max-per-layer).
# n: the next lease's: the shipped pass cap (prefetch.pass_max_per_layer = auto) against off,
#    cold twice and on the page cache.
set -uo pipefail
here=$(dirname "$0")
step=$1
. "$here/h200_lib.sh"
ptx_restore
rss_table() {  # rss_table JSON...: each case's host peak, its marks, and the peak above the runtime
  python3 - "$@" <<'PY'
import json, sys
for p in sys.argv[1:]:
    rep = json.load(open(p))
    for r in rep["results"]:
        m = r.get("memory") or {}
        print(p.rsplit("/", 1)[-1], r["name"], "peak", round(r["peak_rss_mb"]), "process",
              round(m.get("process_mb") or 0), "runtime", round(m.get("runtime_mb") or 0),
              "tokenizer", round(m.get("tokenizer_mb") or 0), "device", round(r.get("peak_device_mb", 0)),
              "tok/s", round(r["decode_tok_s"], 2), "maps", r.get("rss_by_mapping"))
    print({k: round(v) for k, v in rep["derived"].items() if k.endswith("rss_over_runtime_mb")})
PY
}
{
case $step in
  m)
    python3 benchmarks/runtime_rss.py
    c35m
    bench 300 m-cold-1 c35m "${cold[@]}" --cases default,resident
    bench 300 m-cold-2 c35m "${cold[@]}" --cases default,resident
    bench 200 m-paged c35m "${warm[@]}" --warm --cases default  # waited tokens' device peak
    rss_table "$OUT"/m-*.json
    ptx_save ;;
  p)  # where the engine's host time a token goes, every expert pooled (MLX thread, cProfile)
    c35m
    timeout 400 python3 benchmarks/host_cpu_token.py "$DATA/c35m.qpack" --tokens 24 --profile 45 \
      2> "$OUT/p-profile.txt" | tail -1
    grep -v "Z \[" "$OUT/p-profile.txt" | head -60 ;;
  s)  # cold speculation with the pass's predicted union cut to its best N (prefetch.max_per_layer)
    c35m
    for cap in 0 12 16; do
      extra=(); [ "$cap" = 0 ] || extra=(--max-per-layer "$cap")
      TAIL=6 bench 200 s-cap$cap c35m "${cold[@]}" --routing calibrated-gate \
        --cases default,spec-k2-a0.8,spec-auto-a0.8 "${extra[@]}"
    done
    python3 - "$OUT"/s-cap*.json <<'PY'
import json, sys
for p in sys.argv[1:]:
    for r in json.load(open(p))["results"]:
        rp = r["read_path"]
        print(p.rsplit("/", 1)[-1], r["name"], round(r["decode_tok_s"], 2), "MB/tok",
              round(r["decode_bytes_per_token"] / 1e6, 1), "in vain", round(rp["wasted_mb"]),
              "busy", round(rp["disk_busy_fraction"], 2), "GB/s", round(rp["disk_gb_s"], 2),
              "P/R", round(r["prefetch_precision"], 2), round(r["prefetch_recall"], 2))
PY
    ;;
  n)  # the next lease: the shipped pass cap (auto) against none, cold twice, then the page cache
    c35m
    for i in 1 2; do
      for cap in auto off; do
        TAIL=6 bench 200 n-cold-$cap-$i c35m "${cold[@]}" --routing calibrated-gate \
          --cases default,spec-k2-a0.8,spec-auto-a0.8 --pass-max-per-layer $cap
      done
    done
    for cap in auto off; do
      TAIL=6 bench 200 n-paged-$cap c35m "${warm[@]}" --warm --routing calibrated-gate \
        --cases default,spec-k2-a0.8 --pass-max-per-layer $cap
    done ;;
  *) echo "unknown step $step: m, p, s or n" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
