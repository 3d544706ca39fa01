#!/usr/bin/env bash
# Session 35 (2026-12-05): the CUDA Gated DeltaNet kernel (pipeline/models/deltanet_kernel.py).
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session35.sh STEP
# k: the kernel against mlx-lm's ops path on random inputs at the 35B's DeltaNet dims
#    (benchmarks/deltanet_kernel_check.py): differences, time per call, MLX peak; one row and
#    two (the second padded, as batched prefill pads).
# b: issue 25/31's 1024-token prompt and warm-all decode on c35m, the kernel on and off
#    (MOESTREAM_DELTANET_KERNEL=0: mlx-lm's ops, in the engine and the resident reference
#    alike), alternating: TTFT, device peak, temporaries, decode tok/s.
# e: where the 1024-token prompt's device peak is reached with the kernel on
#    (benchmarks/eval_peaks.py: each mx.eval's peak above the memory active at the call).
# n (next lease): issue 25's device memory with the bench forgetting its warm-up's prompt
#    states (split: `copies`): the 1024-token prompt, kernel on and off, and cold decode.
# s (next lease): issue 24's warm speculation pairs (`auto` never hitting, a = 0.8) with the
#    kernel on and off: verify passes of 2-3 positions ran 2-3 DeltaNet steps of ops a layer.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  k)
    python3 benchmarks/deltanet_kernel_check.py --tokens 1 16 256 1024 2>&1 | tee "$OUT/k1.jsonl"
    python3 benchmarks/deltanet_kernel_check.py --tokens 1 64 --batch 2 2>&1 | tee "$OUT/k2.jsonl" ;;
  b)
    c35m
    for i in 1 2; do
      TAIL=2 bench 200 long-on-$i c35m --pool-mb 1024 --max-tokens 16 --warm --cases long-prompt --long-prompt 1024
      MOESTREAM_DELTANET_KERNEL=0 TAIL=2 bench 200 long-off-$i c35m --pool-mb 1024 --max-tokens 16 --warm \
        --cases long-prompt --long-prompt 1024
    done
    python3 - "$OUT"/long-*.json <<'PY'
import json, sys
for p in sys.argv[1:]:
    for r in json.load(open(p))["results"]:
        m = r.get("memory", {})
        print(p.rsplit("/", 1)[-1], round(r["prefill_tok_s"], 1), round(r["ttft_s"], 2), round(r["decode_tok_s"], 2),
              round(r["peak_device_mb"]), round(r["decode_device_mb"]),
              {k: round(m.get(k, 0)) for k in ("temporaries_mb", "dense_mb", "pool_mb", "state_mb")})
PY
    same "$OUT"/long-on-*.json
    same "$OUT"/long-off-*.json
    TAIL=1 bench 250 warm-on c35m "${warm[@]}" --cases warm-all
    MOESTREAM_DELTANET_KERNEL=0 TAIL=1 bench 250 warm-off c35m "${warm[@]}" --cases warm-all
    pairs_table "$OUT"/warm-*.json
    pairs_over "$OUT"/warm-on.json
    pairs_over "$OUT"/warm-off.json ;;
  e)
    c35m
    timeout 300 python3 benchmarks/eval_peaks.py bench "$DATA/c35m.qpack" --pool-mb 1024 --max-tokens 4 --warm \
      --cases long-prompt --long-prompt 1024 --json "$OUT/peaks.json" 2>&1 | grep -v "Z \[" | tail -20 ;;
  n)
    c35m
    TAIL=2 bench 200 n-long-on c35m --pool-mb 1024 --max-tokens 16 --warm --cases long-prompt --long-prompt 1024
    MOESTREAM_DELTANET_KERNEL=0 TAIL=2 bench 200 n-long-off c35m --pool-mb 1024 --max-tokens 16 --warm \
      --cases long-prompt --long-prompt 1024
    for i in 1 2; do TAIL=1 bench 120 n-cold-$i c35m "${cold[@]}" --cases default; done
    python3 - "$OUT"/n-*.json <<'PY'
import json, sys
for p in sys.argv[1:]:
    for r in json.load(open(p))["results"]:
        m = r.get("memory", {})
        print(p.rsplit("/", 1)[-1], round(r["decode_tok_s"], 2), round(r["prefill_tok_s"], 1), round(r["peak_device_mb"]),
              round(r["decode_device_mb"]), {k: round(m.get(k) or 0) for k in ("state_mb", "copies_mb", "temporaries_mb")})
PY
    ;;
  s)
    c35m
    TAIL=1 bench 280 s-on c35m "${warm[@]}" --cases warm-spec-auto,warm-spec-auto-a0.8
    MOESTREAM_DELTANET_KERNEL=0 TAIL=1 bench 280 s-off c35m "${warm[@]}" --cases warm-spec-auto,warm-spec-auto-a0.8
    pairs_table "$OUT"/s-*.json
    pairs_over "$OUT"/s-on.json
    pairs_over "$OUT"/s-off.json ;;
  *) echo "unknown step $step: k, b, e, n or s" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
