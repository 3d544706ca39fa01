"""One line per bench case: decode rate and where its read path's time went.

    python benchmarks/read_path_summary.py RESULT.json [...]

For comparing many `moestream bench --json` runs of one lease at a glance (the bench's
own tables are per invocation)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def line(source: str, r: dict) -> str:
    p = r.get("read_path") or {}
    keys = ("disk_busy_fraction", "mean_in_flight", "decode_s", "mlx_s", "stall_late_s",
            "stall_unpredicted_s", "queue_ms", "pread_ms", "answer_ms", "gap_ms", "gpu_gap_ms", "tail_ms",
            "back_ms", "poll_ms", "gpu_look_ms", "ready_fraction")
    parts = [f"{source} {r['name']}: {r['decode_tok_s']:.2f} tok/s",
             f"{r['decode_bytes_per_token'] / 1e6:.0f} MB/token", f"readers {r['readers']}" + (f" ({r['reader_io']})" if r.get("reader_io") else "")]
    parts += [f"{k} {p[k]:.2f}" for k in keys if k in p]
    if "waited_tokens" in p:  # tokens queued whole (compute.device_wait): 0 where it declined
        parts.append(f"waited_tokens {p['waited_tokens']}")
    if p.get("thread_cpu_s"):
        parts.append("cpu " + json.dumps(p["thread_cpu_s"]))
    return ", ".join(parts)


def main(paths: list[str]) -> int:
    for path in paths:
        for r in json.loads(Path(path).read_text())["results"]:
            if r["kind"] == "io":
                print(f"{Path(path).stem} io: {r['read_gb_s']:.2f} GB/s with {r['readers']} readers")
            elif not r.get("error"):
                print(line(Path(path).stem, r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
