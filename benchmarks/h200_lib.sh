# Sourced by the per-session H200 scripts (benchmarks/h200_session*.sh): where containers
# and results live on the GPU host, and `bench`, one `moestream bench` with its own limit.
DATA=${DATA:-/tmp/bench-data}; OUT=${OUT:-$PWD/bench-out}
mkdir -p "$DATA" "$OUT"
export PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR=$DATA/ptx-cache
B="python3 benchmarks/moestream_bench.py"
cold=(--pool-mb 1024 --o-direct --max-tokens 24)
warm=(--pool-mb 1024 --max-tokens 32)  # the page cache or every expert pooled
bench() {  # bench LIMIT_S NAME CONTAINER ARGS...
  local limit=$1 name=$2 c=$3; shift 3
  echo "== $(date -u +%T) $name: $*"
  timeout "$limit" $B bench "$DATA/$c.qpack" --json "$OUT/$name.json" "$@" 2>&1 | tail -"${TAIL:-16}"
  echo "== $(date -u +%T) $name rc ${PIPESTATUS[0]}"
}

# MLX compiles its CUDA kernels on first use, ~140 s of a lease's first 35B bench (session
# 13: 167 s against 24 s once cached), and a fresh lease starts with an empty cache.
# `ptx_save` leaves the cache in $OUT as one file; a later session copies it into .ptx/
# (git-ignored) and carries it beside .gpu1 (64 MiB per call in all); `ptx_restore`
# unpacks it before the first bench (session 16: 2.0 MB. Restored from a lease that ran only
# decode, it left the 1024-token prefill's first run at 135 s, 178 in session 15 without it;
# run again in the same lease, 33 s: save it after the step that compiled what you need).
ptx_save() { tar czf "$OUT/ptx-cache.tgz" -C "$DATA" ptx-cache && du -h "$OUT/ptx-cache.tgz"; }
# A fresh VM has no .ptx/: the newest cache a session committed beside its results
# (benchmarks/results/h200/session*/ptx-cache.tgz; MLX 0.32.4, sm_90) stands in for it.
ptx_restore() {
  local saved=.ptx/ptx-cache.tgz
  [ -f "$saved" ] || saved=$(ls -1 benchmarks/results/h200/session*/ptx-cache.tgz 2>/dev/null | sort -V | tail -1)
  [ -f "$saved" ] && tar xzf "$saved" -C "$DATA" && echo "ptx cache restored from $saved"; true
}
same() {  # every case's tokens against the first case's, within one or more JSON files
  python3 - "$@" <<'PY'
import json, sys
runs = [r for p in sys.argv[1:] for r in json.load(open(p))["results"] if r.get("token_ids")]
if runs:
    ref = runs[0]
    print("tokens as", ref["name"], {r["name"]: r["token_ids"] == ref["token_ids"] for r in runs[1:]})
PY
}

# The bench containers, each written once per lease (the full 35B ~55 s, its 4-layer cut
# ~20 s, the 80B ~60 s); `pack`: a step's JSON as one archive (at most 8 files come back).
container() {  # container NAME PRESET [bench-container ARGS...]: $DATA/NAME.qpack, unless there
  local name=$1 preset=$2; shift 2
  [ -f "$DATA/$name.qpack/manifest.json" ] || $B bench-container --preset "$preset" "$@" -o "$DATA/$name.qpack" 2>&1 | tail -1
}
c35() { container c35 qwen3.6-35b-a3b; }
c35m() { container c35m qwen3.6-35b-a3b --mtp; }  # with its MTP layer (sessions 31-33)
c35x4() { container c35x4 qwen3.6-35b-a3b --max-layers 4; }
c80() { container c80 qwen3-next-80b-a3b; }
only() {  # only CONTAINER: remove the other bench containers (the disk holds one big one)
  for d in "$DATA"/*.qpack; do [ "$(basename "$d" .qpack)" = "$1" ] || rm -rf "$d"; done
}
paged() {  # paged NAME (c35, c35x4, c80): alone on the disk, written if missing, its experts in the page cache
  only "$1"; "$1"; cat "$DATA/$1.qpack"/experts/* > /dev/null
}
pack() { tar czf "$OUT/$step-json.tgz" -C "$OUT" $(cd "$OUT" && ls *.json) && rm -f "$OUT"/*.json; }
old_bench() {  # old_bench ARCHIVE LIMIT NAME ARGS...: `bench` with the code in .ptx/ARCHIVE.tgz
  local code=/tmp/$1; shift  # (a `git archive` of an earlier commit: before/after in one lease)
  mkdir -p "$code" && tar xzf ".ptx/$(basename "$code").tgz" -C "$code"
  (cd "$code" && PYTHONPATH=/tmp/site:$code OUT=$OUT DATA=$DATA bash -c '. benchmarks/h200_lib.sh
    bench "$@"' _ "$@")
}
pairs_table() {  # pairs_table JSON...: each case's tok/s, device peak and its alternating pairs
  python3 - "$@" <<'PY'
import json, sys
for p in sys.argv[1:]:
    for r in json.load(open(p))["results"]:
        print(p.rsplit("/", 1)[-1], r["name"], round(r["decode_tok_s"], 2), round(r.get("peak_device_mb", 0)),
              [round(x, 1) for x in r.get("paired_engine_tok_s", [])],
              [round(x, 1) for x in r.get("paired_resident_tok_s", [])])
PY
}
graphs_step() {  # graphs_step CONTAINER: warm-all and the page cache, CUDA graphs on / off / a larger cache
  local c=$1
  TAIL=1 bench 200 graphs-default "$c" "${warm[@]}" --warm --cases warm-all
  MLX_USE_CUDA_GRAPHS=0 TAIL=1 bench 200 graphs-off "$c" "${warm[@]}" --warm --cases warm-all
  MLX_CUDA_GRAPH_CACHE_SIZE=4000 TAIL=1 bench 200 graphs-4000 "$c" "${warm[@]}" --warm --cases warm-all
  TAIL=1 bench 100 graphs-fast-default "$c" "${warm[@]}" --warm --cases default
  MLX_USE_CUDA_GRAPHS=0 TAIL=1 bench 100 graphs-fast-off "$c" "${warm[@]}" --warm --cases default
  same "$OUT"/graphs-*.json
  pairs_table "$OUT"/graphs-*.json
}
deep_step() {  # deep_step CONTAINER: the page cache's waited token, lookahead 2-3 and io_uring at 8-16 in flight
  local c=$1
  TAIL=1 bench 100 deep-default "$c" "${warm[@]}" --warm --cases default
  TAIL=1 bench 100 deep-r8 "$c" "${warm[@]}" --warm --cases default --io uring --readers 8
  for depth in 2 3; do
    TAIL=1 bench 100 deep-d$depth-r8 "$c" "${warm[@]}" --warm --cases default --strategy lookahead \
      --depth $depth --io uring --readers 8
  done
  TAIL=1 bench 100 deep-d2-r16 "$c" "${warm[@]}" --warm --cases default --strategy lookahead --depth 2 \
    --io uring --readers 16
  python3 benchmarks/read_path_summary.py "$OUT"/deep-*.json
  same "$OUT"/deep-*.json
}
hostcpu() {  # hostcpu NAME [ENV...]: host CPU per token, the engine's MLX thread against the
  # resident's, each loaded as `bench` loads it (benchmarks/host_cpu_token.py), on $C (c35m)
  local name=$1; shift
  echo "== $(date -u +%T) hostcpu $name: $*"
  env "$@" timeout 250 python3 benchmarks/host_cpu_token.py "$DATA/${C:-c35m}.qpack" --tokens 24 --profile 25 \
    --dtype model 2>&1 | grep -v "Z \[" | tail -45 | tee "$OUT/hostcpu-$name.txt"
  echo "== $(date -u +%T) hostcpu $name rc ${PIPESTATUS[0]}"
}
kv_step() {  # kv_step: issue 25's 1024-token prompt on c35m, kv_bits 0 and 4 (4 is refused at start on CUDA)
  c35m
  for bits in 0 4; do
    TAIL=2 bench 200 kv-$bits c35m --pool-mb 1024 --max-tokens 16 --warm --cases long-prompt \
      --long-prompt 1024 --kv-bits $bits
  done
}
pairs_over() {  # pairs_over JSON: each case's ratios ("over") and paired runs
  python3 - "$1" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(r["name"], {k: v for k, v in r.items() if "over" in k or k.startswith("paired_")})
PY
}
