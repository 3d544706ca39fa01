#!/usr/bin/env bash
# Session 38 (2026-12-06): issue 31's warm-all gap, MLX's per-graph input cap.
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session38.sh STEP
# MLX's CUDA encoder commits its graph once the inputs of the ops in it pass
# MLX_MAX_MB_PER_BUFFER (1000 MB on cc 9.0, mlx/backend/cuda/device.cpp): with every expert
# of the 35B pooled, a bank is 2,048 slots and each of its arrays ~1 GiB, so every expert
# gather commits a graph of its own (~3 a MoE layer), where mlx-lm's per-layer arrays
# (~128 MB) commit every few layers. Banks of one layer (`--bank-slots 256`) make the
# gathers' inputs the resident model's size; the raised cap is the same lever from MLX's side.
# a: the container and the shipped warm-all pair (compiles the kernels; saves the PTX cache).
# b: warm-all with one layer a bank, and with the cap raised.
# p: the engine's MLX thread profiled against resident mlx-lm's host CPU a token.
set -uo pipefail
here=$(dirname "$0")
step=$1
. "$here/h200_lib.sh"
ptx_restore
{
case $step in
  a)
    c35m
    TAIL=3 bench 330 w-shipped c35m "${warm[@]}" --cases warm-all
    pairs_table "$OUT"/w-*.json
    ptx_save ;;
  b)
    TAIL=3 bench 200 w-bank256 c35m "${warm[@]}" --cases warm-all --bank-slots 256
    MLX_MAX_MB_PER_BUFFER=1000000 TAIL=3 bench 200 w-mb c35m "${warm[@]}" --cases warm-all
    pairs_table "$OUT"/w-*.json ;;
  c)
    TAIL=3 bench 200 w-shipped-2 c35m "${warm[@]}" --cases warm-all
    TAIL=3 bench 200 w-bank256-2 c35m "${warm[@]}" --cases warm-all --bank-slots 256
    pairs_table "$OUT"/w-*.json ;;
  p)  # where the engine's host time a token goes, every expert pooled (MLX thread, cProfile)
    c35m
    timeout 400 python3 benchmarks/host_cpu_token.py "$DATA/c35m.qpack" --tokens 24 --profile 45 \
      2> "$OUT/p-profile.txt" | tail -1
    grep -v "Z \[" "$OUT/p-profile.txt" | head -60 ;;
  *) echo "unknown step $step: a, b, c or p" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
