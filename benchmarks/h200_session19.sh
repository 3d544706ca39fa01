#!/usr/bin/env bash
# For the next lease (written in session 18, 2026-12-04): what session 18 changed or
# could not settle, one step per device call. On the GPU host, after the bundle:
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session19.sh STEP
# spec: warm speculation now warms up with its measured generation (pass shapes compiled
#   first): warm-all and the spec cases alternated, twice (the lease is noisy).
# fast: the page cache as a fast disk, next-gate against lookahead depth 2, twice.
# long: the 35B 1024-token prefill, twice.
# slices: a 1024-token chunk's MoE halves in slices against the whole chunk, bitwise, on CUDA.
# g20 / q30: issue 27's headline numbers (cold 1 GiB pool, every expert pooled, resident).
# fam NAME PRESET [MAX_LAYERS]: the same for any preset (glm-4.5-air, deepseek-v3 cut to
#   fit the lease's time: each family's first run compiles its own kernels).
# Containers live in $DATA on the device's disk (64 GB: one family container at a time).
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
{
case $step in
  spec)
    c35
    for i in 1 2; do
      bench 200 c35-spec$i c35 "${warm[@]}" --cases warm-all,warm-spec-k2-a0.8,warm-spec-auto-a0.8
    done
    pack ;;
  spec2)  # session 19's pass warm-ups: cold calibrated-gate (the issue's cold target), then warm
    c35
    bench 260 c35-cold-spec c35 "${cold[@]}" --cases default,spec-k2-a0.8,spec-k3-a0.8,spec-auto-a0.8 --routing calibrated-gate
    bench 150 c35-warm-spec c35 "${warm[@]}" --cases warm-all,warm-spec-k2-a0.8,warm-spec-auto-a0.8
    same "$OUT"/c35-*spec.json
    pack ;;
  fast)
    c35
    cat "$DATA"/c35.qpack/experts/* > /dev/null
    for i in 1 2; do
      bench 90 c35-fast$i c35 "${warm[@]}" --warm --cases default
      bench 90 c35-fast-la2-$i c35 "${warm[@]}" --warm --cases default --strategy lookahead --depth 2
    done
    same "$OUT"/c35-fast*.json
    pack ;;
  long)
    c35
    for i in 1 2; do bench 300 c35-long$i c35 "${cold[@]}" --cases long-prompt,io; done
    pack ;;
  slices)  # 4 layers at 35B dims are enough for one chunk's bits
    [ -f "$DATA/c35x4.qpack/manifest.json" ] || $B bench-container --preset qwen3.6-35b-a3b --max-layers 4 -o "$DATA/c35x4.qpack" 2>&1 | tail -1
    python3 benchmarks/moe_slices_check.py "$DATA/c35x4.qpack" 1024
    python3 benchmarks/moe_slices_check.py "$DATA/c35x4.qpack" 1024 256 ;;
  fam)
    name=$2; step=$2
    only "$name"
    [ -f "$DATA/$name.qpack/manifest.json" ] || $B bench-container --preset "$3" ${4:+--max-layers $4} -o "$DATA/$name.qpack" 2>&1 | tail -1
    du -sh "$DATA/$name.qpack"
    bench "${LIMIT:-520}" "$name" "$name" "${cold[@]}" --cases default,io,warm-all,resident
    ptx_save; pack ;;
  g20)
    only g20
    [ -f "$DATA/g20.qpack/manifest.json" ] || $B bench-container --preset gpt-oss-20b -o "$DATA/g20.qpack" 2>&1 | tail -1
    bench 400 g20 g20 "${cold[@]}" --cases default,io,warm-all,resident
    pack ;;
  q30)
    only q30
    [ -f "$DATA/q30.qpack/manifest.json" ] || $B bench-container --preset qwen3-30b-a3b -o "$DATA/q30.qpack" 2>&1 | tail -1
    bench 400 q30 q30 "${cold[@]}" --cases default,io,warm-all,resident
    pack ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
