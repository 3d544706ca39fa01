#!/usr/bin/env bash
# Side by side in one lease (issue "Keep the disk busy"): the same full-dims container
# benched by the code before the read-path rewrite (a `git archive` of it in $BASE) and by
# this checkout, then this checkout's variants. Run on the GPU host with
# PYTHONPATH=/tmp/site (the checkout's own path is set per run here).
#   bash benchmarks/read_path_compare.sh write PRESET TAG
#   bash benchmarks/read_path_compare.sh base TAG [bench flags]      # $BASE's code
#   bash benchmarks/read_path_compare.sh new NAME TAG [bench flags]  # this checkout
set -uo pipefail
DATA=${DATA:-/tmp/bench-data}
OUT=${OUT:-$PWD/bench-out}
BASE=${BASE:-$PWD/.bench-base}
mkdir -p "$DATA" "$OUT"
export PYTHONUNBUFFERED=1
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$DATA/ptx-cache}
SITE=${SITE:-/tmp/site}
# FAST=1: no O_DIRECT, the page cache kept warm (a stand-in for a fast SSD).
if [ -n "${FAST:-}" ]; then COMMON=(--pool-mb 1024 --warm); else COMMON=(--pool-mb 1024 --o-direct); fi
COMMON+=(--max-tokens 24)
mode=$1; shift
case $mode in
  write)
    preset=$1; tag=$2
    rm -rf "$DATA/$tag.qpack"
    PYTHONPATH=$SITE:$PWD python3 benchmarks/moestream_bench.py bench-container --preset "$preset" -o "$DATA/$tag.qpack" 2>&1 | tail -2 ;;
  base)
    tag=$1; shift
    echo "== $(date -u) base $tag $*"
    (cd "$BASE" && PYTHONPATH=$SITE:$BASE python3 benchmarks/moestream_bench.py bench "$DATA/$tag.qpack" \
      --cases "${CASES:-default,io}" "${COMMON[@]}" --json "$OUT/base-${NAME:-x}-$tag.json" "$@" 2>&1 | tail -12) ;;
  new)
    name=$1; tag=$2; shift 2
    echo "== $(date -u) new $name $tag $*"
    PYTHONPATH=$SITE:$PWD python3 benchmarks/moestream_bench.py bench "$DATA/$tag.qpack" \
      --cases "${CASES:-default,io}" "${COMMON[@]}" --json "$OUT/$name-$tag.json" "$@" 2>&1 | tail -22 ;;
  cache)
    tag=$1; cat "$DATA/$tag.qpack"/experts/* "$DATA/$tag.qpack"/*.safetensors > /dev/null ;;
esac
