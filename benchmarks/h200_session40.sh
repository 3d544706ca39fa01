#!/usr/bin/env bash
# Session 40 (2026-12-06): issue 24's cold target as a rule, not one run beside one.
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/h200_session40.sh STEP
# Session 40's first lease (h200_session39.sh n, an H100 whose disk read 1.5-2.1 GB/s)
# gave cold plain decode 4.16-4.93 tok/s over four runs, so one speculating run over the
# plain run beside it read 1.16-1.57x for one configuration. `bench --rounds N` runs the
# case list N times, one round after the other, and reports the median of the rounds'
# ratios (pipeline/bench/rounds.py).
# r: cold, calibrated gate, the shipped defaults (prefetch.pass_max_per_layer = auto), 4 rounds.
# o: the same with the pass's predicted union whole (off), 3 rounds.
# c: k = 2 only, the pass's union cut to 12 against whole (off), 3 rounds each.
# g: the page cache (every expert file read in first), 3 rounds: `auto` on the bench's
#    prompt (prompt lookup that finds nothing: the back-off's regime) and k = 2 at a = 0.8.
# x: the next lease's first step. `g` drew different tokens run to run (plain decode on the
#    page cache, calibrated routing, waited tokens: 3 rounds, 3 sequences; every cold run of
#    this session agreed). Which part: the waited token (device_wait off against auto), the
#    calibrated routing (router against calibrated), or the fast reads (cold against both).
set -uo pipefail
here=$(dirname "$0")
step=$1
. "$here/h200_lib.sh"
ptx_restore
rounds_table() {  # rounds_table JSON...: each round's tok/s, bytes a token and x plain
  python3 - "$@" <<'PY'
import json, sys
for p in sys.argv[1:]:
    rep = json.load(open(p))
    for r in rep["results"]:
        rp = r["read_path"]
        print(p.rsplit("/", 1)[-1], r["name"], round(r["decode_tok_s"], 2), "MB/tok",
              round(r["decode_bytes_per_token"] / 1e6, 1), "in vain", round(rp["wasted_mb"]),
              "busy", round(rp["disk_busy_fraction"], 2), "GB/s", round(rp["disk_gb_s"], 2),
              "drafts", r.get("drafts_proposed"), r.get("drafts_accepted"))
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rep["derived"].items()
           if "over_plain" in k or k == "decode_tok_s_rounds"})
PY
}
{
case $step in
  r)
    c35m
    TAIL=8 bench 420 r-auto c35m "${cold[@]}" --routing calibrated-gate --rounds 4 \
      --cases default,spec-k2-a0.8,spec-auto-a0.8
    rounds_table "$OUT"/r-auto.json ;;
  o)
    c35m
    TAIL=8 bench 330 o-off c35m "${cold[@]}" --routing calibrated-gate --rounds 3 \
      --cases default,spec-k2-a0.8,spec-auto-a0.8 --pass-max-per-layer off
    rounds_table "$OUT"/o-off.json ;;
  c)
    c35m
    for cap in 12 off; do
      TAIL=8 bench 260 c-$cap c35m "${cold[@]}" --routing calibrated-gate --rounds 3 \
        --cases default,spec-k2-a0.8 --pass-max-per-layer $cap
    done
    rounds_table "$OUT"/c-*.json ;;
  g)
    paged c35m
    TAIL=8 bench 330 g-paged c35m "${warm[@]}" --warm --routing calibrated-gate --rounds 3 \
      --cases default,spec-auto,spec-k2-a0.8
    rounds_table "$OUT"/g-paged.json ;;
  x)
    paged c35m
    for dw in auto off; do
      TAIL=3 bench 200 x-cal-$dw c35m "${warm[@]}" --warm --routing calibrated-gate --rounds 3 \
        --cases default --device-wait $dw
    done
    TAIL=3 bench 200 x-router-auto c35m "${warm[@]}" --warm --rounds 3 --cases default
    python3 - "$OUT"/x-*.json <<'PY'
import json, sys
for p in sys.argv[1:]:
    res = json.load(open(p))["results"]
    ref = res[0]["token_ids"]
    print(p.rsplit("/", 1)[-1], [(r["name"], r.get("awaited_tokens"),
          next((i for i, (a, b) in enumerate(zip(ref, r["token_ids"])) if a != b), None)) for r in res])
PY
    ;;
  *) echo "unknown step $step: r, o, c, g or x" >&2 ;;
esac
} 2>&1 | tee -a "$OUT/$step.log"
