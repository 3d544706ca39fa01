"""One markdown table from `moestream bench --routing ...` JSON files (live runs).

    python benchmarks/live_routing_report.py DIR [DIR...]   -> markdown on stdout

Every moestream case of every `*.json` in DIR becomes a row: the routing (router = the
container's own, random weights; calibrated = the routing model, benchmark only; +gate =
gate strategies see the model's emulated gate-ahead), the pool, strategy and eviction,
decode tok/s, decode hit rate, MB read per decode token and the prefetch precision/recall.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def routing_name(label: str) -> str:
    if label == "router":
        return "router (random)"
    return "calibrated + emulated gate" if "emulated gate" in label else "calibrated"


def rows(paths: list[Path]) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        doc = json.loads(path.read_text())
        for r in doc["results"]:
            if r.get("error") or r["kind"] != "moestream":
                continue
            strategy = r["strategy"] if r.get("overlap", True) else "serial (no prefetch, no overlap)"
            out.append({**r, "strategy": strategy, "file": path.name,
                        "routing_name": routing_name(r.get("routing", "router"))})
    order = {"calibrated + emulated gate": 0, "calibrated": 1, "router (random)": 2}
    return sorted(out, key=lambda r: (r["pool_mb"], order[r["routing_name"]], r["strategy"], r["eviction"]))


def table(found: list[dict[str, Any]]) -> str:
    lines = ["| pool MiB (slots) | routing | strategy | eviction | decode tok/s | hit (decode) | MB read / token | prefetch P / R |",
             "|---|---|---|---|---|---|---|---|"]
    for r in found:
        lines.append(
            f"| {r['pool_mb']:.0f} ({r['slots']}) | {r['routing_name']} | {r['strategy']} | {r['eviction']} "
            f"| {r['decode_tok_s']:.2f} | {r['decode_hit_rate']:.1%} | {r['decode_bytes_per_token'] / 2**20:.2f} "
            f"| {r['prefetch_precision']:.2f} / {r['prefetch_recall']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print("error: give one or more directories of bench JSON files", file=sys.stderr)
        return 2
    paths = sorted(p for d in argv for p in Path(d).glob("*.json"))
    if not paths:
        print(f"error: no *.json in {', '.join(argv)}", file=sys.stderr)
        return 2
    print(table(rows(paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
