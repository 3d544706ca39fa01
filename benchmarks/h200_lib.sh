# Sourced by the per-session H200 scripts (benchmarks/h200_session*.sh): where containers
# and results live on the GPU host, and `bench`, one `moestream bench` with its own limit.
DATA=${DATA:-/tmp/bench-data}; OUT=${OUT:-$PWD/bench-out}
mkdir -p "$DATA" "$OUT"
export PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR=$DATA/ptx-cache
B="python3 benchmarks/moestream_bench.py"
cold=(--pool-mb 1024 --o-direct --max-tokens 24)
bench() {  # bench LIMIT_S NAME CONTAINER ARGS...
  local limit=$1 name=$2 c=$3; shift 3
  echo "== $(date -u +%T) $name: $*"
  timeout "$limit" $B bench "$DATA/$c.qpack" --json "$OUT/$name.json" "$@" 2>&1 | tail -"${TAIL:-16}"
  echo "== $(date -u +%T) $name rc ${PIPESTATUS[0]}"
}
