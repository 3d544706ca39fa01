#!/usr/bin/env bash
# Session 30 (2026-12-05): no device was lent; these steps are for the next lease. On the GPU
# host, after the bundle (carry .gpu2 and .ptx: ptx-cache.tgz):
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session30.sh STEP
# (logs and JSON: bench-out/, kept in benchmarks/results/h200/session30/)
# graphs (issue 31, every expert pooled against resident mlx-lm; the fast disk): MLX's CUDA
#   backend records its kernels into CUDA graphs of up to 100 nodes on an H100/H200 and keeps
#   their executables in an LRU of 400 keyed by the graph's shape; a graph holding a node
#   of another kind (a memcpy) is instantiated anew at every launch, and an update that
#   fails re-instantiates. Resident mlx-lm sped up pair after pair in session 29 (27-34 ->
#   44-56 tok/s) while the engine did not: warm-all's 5 pairs with CUDA graphs off
#   (MLX_USE_CUDA_GRAPHS=0), at a larger cache (MLX_CUDA_GRAPH_CACHE_SIZE=4000) and as
#   shipped, then the page cache's default case (waited tokens) likewise. If the gap moves
#   with graphs off, the engine's graphs are the per-token cost to find (then
#   MLX_SAVE_CUDA_GRAPHS_DOT_FILE on a 2-token run says which nodes).
# pairs (issue 24): h200_session29.sh pairs (warm speculation paired with plain decode).
# prefill (issues 31, 25): h200_session29.sh prefill: the prefill slices leave room for the
#   chunk's own arrays since session 30 (on CUDA ~445-token MoE slices, was 710): the
#   1024-token prefill's share of one pass (0.97 in session 29) and its device peak.
# deep (issue 31, the fast disk): a waited token's reads are issued one layer ahead (the gate's
#   prediction at layer l for l+1), ~7.6 reads of 1.69 MB a layer at ~2 in flight, so the disk
#   idles between layers (busy 0.66-0.70, in flight 1.2-2.9 with 8 in the ring) and only 3-13 %
#   of the layers find their experts ready when published. The page cache reads 36-49 GB/s:
#   bytes read in vain are cheap there, latency is not. Predicting 2-3 layers ahead
#   (lookahead) with the ring at 8-16 in flight, against the default, in one lease.
# kv (compute.kv_bits, session 30): a 4096-token prompt on the 35B in the page cache, 1 GiB pool,
#   unquantized against 8 and 4 bits: device memory at the peak and while decoding, prefill
#   and decode tok/s (the quantized attention's cost on CUDA), in one lease: `kv 0 8 4`, or
#   `kv 0`, `kv 8`, `kv 4` as three calls (each under the 600 s a call may take).
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  graphs)
    paged c35
    graphs_step c35
    ptx_save
    pack ;;
  pairs|prefill)
    bash "$(dirname "$0")/h200_session29.sh" "$step" ;;
  deep)
    paged c35
    deep_step c35
    pack ;;
  kv)  # kv BITS... (one call each if the quantized kernels compile: minutes a new shape)
    paged c35
    for bits in "${@:2}"; do
      TAIL=1 bench 550 kv-$bits c35 --pool-mb 1024 --max-tokens 32 --warm --cases long-prompt \
        --long-prompt 4096 --kv-bits $bits
    done
    python3 - "$OUT"/kv-*.json <<'PY'
import json, sys
for p in sys.argv[1:]:
    for r in json.load(open(p))["results"]:
        print(p.rsplit("/", 1)[-1], r["name"], "prefill", round(r["prefill_tok_s"], 1), "decode",
              round(r["decode_tok_s"], 2), "device MB peak/decode", round(r["peak_device_mb"]),
              round(r["decode_device_mb"]))
PY
    pack ;;
  *) echo "unknown step $step: graphs, deep, pairs, prefill or kv" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
