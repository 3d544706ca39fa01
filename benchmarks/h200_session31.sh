#!/usr/bin/env bash
# Session 31 (2026-12-05): session 30's steps (h200_session30.sh says what each asks) on ONE
# container, the 35B with its MTP layer (c35m: plain decode ignores the MTP tensors), so a
# lease writes 20 GB once. No PTX cache was carried (a fresh VM): the first case compiles.
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session31.sh STEP
# a: graphs (warm-all and the page cache's default, CUDA graphs on/off/larger cache)
# b: deep (lookahead 2-3, io_uring 8-16 in flight) and pairs (warm speculation, two pairs)
# c: prefill (1024 tokens, cold) and kv (4096-token prompt, 0/8/4 bits)
# limits (for the next lease): MLX's CUDA graphs commit when a graph passes 100 ops or its
#   inputs pass 1000 << 20 *elements* (MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER on
#   cc 9.0; set_input_array adds each input's data_size, persistent weights included). Every
#   expert pooled, a MoE layer's three gathers read bank slices of 2,048 slots, 491,520
#   elements a slot (weights, scales, biases; counted on this VM): 1.007G a layer, so the
#   engine's graph commits about once a MoE layer on inputs alone, mlx-lm's (256 experts,
#   126M a layer) once in ~8. At ~100 ops a layer both also commit on the op count, so the
#   arm raising both is the test. warm-all and the page cache with the element cap out of the
#   way (and 400 ops a graph), against the default, alternating; `same` checks the tokens.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  a)
    paged c35m
    graphs_step c35m
    ptx_save
    pack ;;
  b)
    paged c35m
    deep_step c35m
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
  limits)
    paged c35m
    for i in 1 2; do
      TAIL=1 bench 150 limits-default-$i c35m "${warm[@]}" --warm --cases warm-all
      MLX_MAX_MB_PER_BUFFER=1000000 TAIL=1 bench 150 limits-mb-$i c35m "${warm[@]}" --warm --cases warm-all
      MLX_MAX_MB_PER_BUFFER=1000000 MLX_MAX_OPS_PER_BUFFER=400 TAIL=1 bench 150 limits-mb-ops-$i c35m \
        "${warm[@]}" --warm --cases warm-all
    done
    TAIL=1 bench 60 limits-fast-default c35m "${warm[@]}" --warm --cases default
    MLX_MAX_MB_PER_BUFFER=1000000 TAIL=1 bench 60 limits-fast-mb c35m "${warm[@]}" --warm --cases default
    same "$OUT"/limits-*.json
    python3 benchmarks/read_path_summary.py "$OUT"/limits-fast-*.json
    pairs_table "$OUT"/limits-*.json
    pack ;;
  *) echo "unknown step $step: a, b, c or limits" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
