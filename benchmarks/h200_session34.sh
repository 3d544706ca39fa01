#!/usr/bin/env bash
# Session 34 (2026-12-05): the container of sessions 31-33 (c35m: the 35B with its MTP layer).
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session34.sh STEP
# a: issue 24's `auto` at the tokens it does not speculate on (a random MTP head never hits):
#    benchmarks/auto_plain_cost.py, requests "off" / "auto" alternating in one engine, wall and
#    host CPU per token by thread; this code (a backed-off `auto` queues a second step, as plain
#    decode does) against the code before it (.ptx/old34.tgz: `git archive d0c6732`).
# p: the bench's warm speculation pairs with this code; kv: issue 25's kv_bits on CUDA.
# v: `p` again after the MTP catch-up went in pieces (a 40 s stall in p's second pair, twice),
#    then `a`'s measure of this code.
# m: issue 25's 1024-token prompt, this code (DeltaNet slices sized for the five arrays a step
#    a GPU backend holds until they have run) against the code before (.ptx/old34m.tgz:
#    `git archive 521dcae`), twice each, alternating: device peak, MLX temporaries, TTFT.
set -uo pipefail
. "$(dirname "$0")/h200_lib.sh"
step=$1
ptx_restore
apc() {  # apc NAME [DIR]: auto_plain_cost.py on c35m with the code in DIR (this tree by default)
  local name=$1 dir=${2:-$PWD}
  echo "== $(date -u +%T) auto_plain_cost $name"
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 240 python3 benchmarks/auto_plain_cost.py "$DATA/c35m.qpack" \
    --tokens 32 --rounds 3 2>&1 | grep -v "Z \[" | tee "$OUT/apc-$name.json" | python3 -c '
import json, sys
d = json.loads(sys.stdin.read())
for m, rs in d["ms_per_token"].items():
    print(m, [{k: round(v, 2) for k, v in r.items()} for r in rs])
print(d["last_stats"], d["auto_over_plain_tok_s"], "median", d["median"])')
  echo "== $(date -u +%T) auto_plain_cost $name rc $?"
}
{
case $step in
  a)
    paged c35m
    apc new
    mkdir -p /tmp/old34 && tar xzf .ptx/old34.tgz -C /tmp/old34 && cp benchmarks/auto_plain_cost.py /tmp/old34/benchmarks/
    apc old /tmp/old34
    apc new-2 ;;
  p)
    c35m
    TAIL=1 bench 250 pairs c35m "${warm[@]}" --cases warm-all,warm-spec-auto,warm-spec-auto-a0.8
    pairs_table "$OUT"/pairs.json
    pairs_over "$OUT"/pairs.json ;;
  v)
    c35m
    TAIL=1 bench 250 pairs-v c35m "${warm[@]}" --cases warm-spec-auto,warm-spec-auto-a0.8
    pairs_table "$OUT"/pairs-v.json
    pairs_over "$OUT"/pairs-v.json
    apc v ;;
  kv) kv_step ;;
  m)
    c35m
    for i in 1 2; do
      TAIL=2 bench 200 m-new-$i c35m --pool-mb 1024 --max-tokens 16 --warm --cases long-prompt --long-prompt 1024
      TAIL=2 old_bench old34m 200 m-old-$i c35m --pool-mb 1024 --max-tokens 16 --warm --cases long-prompt \
        --long-prompt 1024
    done
    python3 - "$OUT"/m-*.json <<'PY'
import json, sys
for p in sys.argv[1:]:
    for r in json.load(open(p))["results"]:
        m = r.get("memory", {})
        print(p.rsplit("/", 1)[-1], round(r["prefill_tok_s"], 1), round(r["ttft_s"], 2), round(r["peak_device_mb"]),
              {k: round(m.get(k, 0)) for k in ("temporaries_mb", "dense_mb", "pool_mb", "state_mb")})
PY
    same "$OUT"/m-*.json ;;
  *) echo "unknown step $step: a, p, v, kv or m" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
