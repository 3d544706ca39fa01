#!/usr/bin/env bash
# Session 31 (2026-12-05): session 30's steps (h200_session30.sh says what each asks) on ONE
# container, the 35B with its MTP layer (c35m: plain decode ignores the MTP tensors), so a
# lease writes 20 GB once. No PTX cache was carried (a fresh VM): the first case compiles.
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session31.sh STEP
# a: graphs (warm-all and the page cache's default, CUDA graphs on/off/larger cache)
# b: deep (lookahead 2-3, io_uring 8-16 in flight) and pairs (warm speculation, two pairs)
# c: prefill (1024 tokens, cold) and kv (4096-token prompt, 0/8/4 bits)
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
c35m() { container c35m qwen3.6-35b-a3b --mtp; }
{
case $step in
  a)
    paged c35m
    graphs_step c35m
    ptx_save
    pack ;;
  b)
    paged c35m
    TAIL=1 bench 100 deep-default c35m "${warm[@]}" --warm --cases default
    TAIL=1 bench 100 deep-r8 c35m "${warm[@]}" --warm --cases default --io uring --readers 8
    for depth in 2 3; do
      TAIL=1 bench 100 deep-d$depth-r8 c35m "${warm[@]}" --warm --cases default --strategy lookahead \
        --depth $depth --io uring --readers 8
    done
    TAIL=1 bench 100 deep-d2-r16 c35m "${warm[@]}" --warm --cases default --strategy lookahead --depth 2 \
      --io uring --readers 16
    python3 benchmarks/read_path_summary.py "$OUT"/deep-*.json
    same "$OUT"/deep-*.json
    for i in 1 2; do
      TAIL=1 bench 250 pairs-$i c35m "${warm[@]}" --cases warm-all,warm-spec-auto,warm-spec-auto-a0.8,warm-spec-k2-a0.8
    done
    pack ;;
  c)
    only c35m; c35m
    TAIL=3 bench 330 prefill c35m "${cold[@]}" --cases long-prompt,io
    cat "$DATA"/c35m.qpack/experts/* > /dev/null
    for bits in "${@:2}"; do
      TAIL=1 bench 250 kv-$bits c35m --pool-mb 1024 --max-tokens 32 --warm --cases long-prompt \
        --long-prompt 4096 --kv-bits $bits
    done
    pack ;;
  *) echo "unknown step $step: a, b or c" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
