"""A waited token's layers from a `bench --trace` timeline (issue 31, the fast disk): for
each MoE layer, when the host saw it published (ms from the token's launch), how long its
answer took, its reads (prefetched / demanded) and when they started and ended relative
to the publication, and the gap from the previous answer. Then the token's build and
evaluation, and the means over the layers after the first.

    python benchmarks/waited_layers.py TIMELINE.json[.gz] [--token 6]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def load(path: Path) -> list[dict[str, Any]]:
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    data = json.loads(raw)
    return data["traceEvents"] if isinstance(data, dict) else data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("timeline", type=Path)
    ap.add_argument("--token", type=int, default=6, help="which waited token (0: the first)")
    args = ap.parse_args()
    events = load(args.timeline)
    launches = [e for e in events if e.get("name") == "launch"]
    if not launches:
        raise SystemExit("no waited token in this timeline (device_wait off?)")
    token = launches[min(args.token, len(launches) - 1)]
    t0, t1 = token["ts"], token["ts"] + token["dur"]
    inside = [e for e in events if e.get("ph") == "X" and t0 <= e["ts"] <= t1]
    for e in inside:
        if e["name"] in ("build", "eval"):
            print(f"{e['name']}: starts {(e['ts'] - t0) / 1e3:.2f} ms, {e['dur'] / 1e3:.2f} ms")
    answers = {e["args"]["layer"]: e for e in inside if e["name"] == "answer"}
    reads: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("name") in ("prefetch", "read") and t0 - 5_000 <= e["ts"] <= t1:  # not the last token's
            reads[e["args"]["layer"]].append(e)
    print("layer  seen ms  answer ms  reads (prefetch+demand)  first start / last end ms  gap ms")
    previous = None
    answer_ms, gap_ms = [], []
    for layer in sorted(answers):
        a = answers[layer]
        seen = a["ts"]
        rs = reads.get(layer, [])
        pre = sum(r["name"] == "prefetch" for r in rs)
        span = (f"{(min(r['ts'] for r in rs) - seen) / 1e3:7.2f} / {(max(r['ts'] + r['dur'] for r in rs) - seen) / 1e3:6.2f}"
                if rs else "      - /      -")
        gap = (seen - previous) / 1e3 if previous is not None else None
        print(f"{layer:5d}  {(seen - t0) / 1e3:7.2f}  {a['dur'] / 1e3:9.2f}  {pre:3d} + {len(rs) - pre:<3d}"
              f"                {span}     {'' if gap is None else f'{gap:.2f}'}")
        if previous is not None:
            answer_ms.append(a["dur"] / 1e3)
            gap_ms.append(gap)
        previous = a["ts"] + a["dur"]
    if answer_ms:
        n = len(answer_ms)
        print(f"layers after the first: answer {sum(answer_ms) / n:.2f} ms, gap {sum(g for g in gap_ms if g) / n:.2f} ms "
              f"(mean of {n})")


if __name__ == "__main__":
    main()
