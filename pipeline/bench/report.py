"""Presenting `bench` results: a rich table, the JSON file, and PNG plots (matplotlib).

Plots need matplotlib (an optional extra); without it they are skipped with a note.
- `plot_sweep`: decode tok/s against pool size, one line per prefetch strategy.
- `plot_timeline`: one decode step from a trace, one row per actor track.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actors import timeline


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _peak_dec(r: dict[str, Any], what: str) -> str:
    """Process peak / peak while decoding (the latter only where the case measured it)."""
    peak, dec = r.get(f"peak_{what}_mb", 0.0), r.get(f"decode_{what}_mb", 0.0)
    return f"{peak:.0f}/{dec:.0f}" if dec else f"{peak:.0f}"


def _routing_tag(r: dict[str, Any]) -> str:
    """Benchmark-only calibrated routing is marked on every row that used it."""
    label = r.get("routing", "router")
    if label == "router":
        return ""
    return " @calibrated+gate" if "emulated gate" in label else " @calibrated"


def _bytes_per_token(r: dict[str, Any]) -> float:
    """Bytes read per decoded token: the decode's alone, or for a batch case (which does
    not split them) the whole run's over its decoded tokens."""
    return r["bytes_read_per_token"] if r.get("concurrency") else r["decode_bytes_per_token"]


def results_table(report: dict[str, Any]):  # -> rich.table.Table
    from rich.table import Table

    c = report["container"]
    table = Table(title=f"moestream bench: {c.get('source', c['path'])} ({report['machine'].get('device', '?')})")
    cols = ("case", "decode tok/s", "prefill tok/s", "TTFT s", "pool MB", "readers", "strategy",
            "hit", "hit (decode)", "MB read/tok", "prefetch P/R", "stall", "RSS MB peak/dec", "device MB peak/dec")
    for col in cols:
        table.add_column(col, justify="left" if col in ("case", "strategy") else "right")
    for r in report["results"]:
        if r.get("error"):
            table.add_row(r["name"], f"[red]{r['error'][:60]}[/red]", *[""] * (len(cols) - 2))
            continue
        if r["kind"] == "io":
            table.add_row(r["name"], "-", "-", "-", "-", str(r["readers"]),
                          f"read {r['read_gb_s']:.2f} GB/s" + (" O_DIRECT" if r["o_direct"] else ""),
                          *["-"] * 7)
            continue
        stream = r["kind"] == "moestream"
        # A batch case measures the whole run (prefills included) and not the decode
        # alone, the prefetcher or the stalls: those cells stay empty.
        single = stream and not r.get("concurrency")
        table.add_row(
            r["name"], _f(r["decode_tok_s"]), _f(r["prefill_tok_s"], "{:.1f}"), _f(r["ttft_s"]),
            _f(r["pool_mb"], "{:.0f}"),
            (f"{r['readers']}{' ring' if r.get('reader_io') == 'uring' else ''}") if stream else "-",
            (f"{r['strategy']}, {r.get('eviction') or '?'}{_routing_tag(r)}") if stream else "resident",
            _f(r["hit_rate"], "{:.1%}") if stream else "-",
            _f(r["decode_hit_rate"], "{:.1%}") if single else "-",
            _f(_bytes_per_token(r) / 2**20) if stream else "-",
            f"{r['prefetch_precision']:.2f}/{r['prefetch_recall']:.2f}" if single else "-",
            _f(r["stall_fraction"], "{:.0%}") if single else "-",
            _peak_dec(r, "rss"), _peak_dec(r, "device"),
        )
    d = report.get("derived", {})
    table.caption = "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())
    return table


def read_path_table(report: dict[str, Any]):  # -> rich.table.Table | None
    """Where each cold case's decode time went on the read path (None if none measured)."""
    from rich.table import Table

    rows = [r for r in report["results"] if not r.get("error") and r.get("read_path")
            and r["read_path"].get("decode_s")]
    if not rows:
        return None
    table = Table(title="read path while decoding (per read: ms)")
    cols = ("case", "disk busy", "in flight", "disk GB/s", "MLX s", "stall late s", "stall unpredicted s",
            "in vain MB", "shelved MB", "queue", "pread", "stager wait", "crc32", "to device", "copy",
            "waited / answer / gap ms / ready", "busiest threads (CPU s)")
    for col in cols:
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        p = r["read_path"]
        table.add_row(
            r["name"], f"{p['disk_busy_fraction']:.0%}", f"{p['mean_in_flight']:.2f}",
            f"{p['disk_gb_s']:.2f}", f"{p['mlx_s']:.2f}", f"{p['stall_late_s']:.2f}",
            f"{p['stall_unpredicted_s']:.2f}", f"{p['wasted_mb']:.0f}", f"{p['shelved_mb']:.0f}",
            *(f"{p[k]:.2f}" for k in ("queue_ms", "pread_ms", "finish_wait_ms", "check_ms", "stage_ms")),
            # "direct" copies inside the install (no staging thread): its "to device" is 0.
            r.get("device_copy") or "-",
            # Tokens queued whole (compute.device_wait) / the host's ms per layer answered /
            # the GPU's work and the host's delay after it / layers with every expert in place.
            (f"{p['waited_tokens']} / {p['answer_ms']:.2f} / {p.get('gap_ms', 0):.2f} / "
             f"{p.get('ready_fraction', 0):.0%}") if p["waited_tokens"] else "-",
            # Against "decode s": the host thread that nears it is the cap (thread_cpu.py).
            ", ".join(f"{g} {s:.2f}" for g, s in list(p.get("thread_cpu_s", {}).items())[:3]) or "-",
        )
    return table


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")  # a reader never sees half a file
    part.write_text(json.dumps(report, indent=2, default=str) + "\n")
    part.replace(out)
    return out


def _pyplot():  # -> matplotlib.pyplot | None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_sweep(results: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """Decode tok/s vs pool MB, one line per strategy (moestream results only)."""
    plt = _pyplot()
    if plt is None:
        return None
    # Per strategy: (pool MiB, decode tok/s, MiB read per decode token).
    lines: dict[str, list[tuple[float, float, float]]] = {}
    for r in results:
        if r.get("error") or r["kind"] != "moestream":
            continue
        lines.setdefault(r["strategy"] or "none", []).append(
            (r["pool_mb"], r["decode_tok_s"], _bytes_per_token(r) / 2**20))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, pts in sorted(lines.items()):
        pts.sort()
        pool = [p[0] for p in pts]
        ax.plot(pool, [p[1] for p in pts], marker="o", label=name)
        ax2.plot(pool, [p[2] for p in pts], marker="o", label=name)
    for r in results:
        if r["kind"] == "resident" and not r.get("error"):
            ax.axhline(r["decode_tok_s"], color="k", linestyle="--", label="resident (mlx-lm)")
    ax.set_xlabel("expert pool (MiB)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(title or "decode speed vs pool size", fontsize=9)
    ax2.set_xlabel("expert pool (MiB)")
    ax2.set_ylabel("MiB read per decode token")
    ax2.set_title("expert bytes read per decode token", fontsize=9)
    for a in (ax, ax2):
        a.grid(True, alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def decode_step_window(trace: dict[str, Any], which: float = 0.5) -> tuple[float, float] | None:
    """The [start, end] (µs) of one decode step: the one at fraction `which` of the run."""
    steps = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"] == "decode-step"]
    if not steps:
        return None
    step = steps[min(len(steps) - 1, int(len(steps) * which))]
    return step["ts"], step["ts"] + step["dur"]


def plot_timeline(trace_path: str | Path, path: str | Path, title: str = "") -> Path | None:
    """One decode step, one row per track: MLX calls, stalls, installs, reads."""
    plt = _pyplot()
    if plt is None:
        return None
    trace = timeline.load(trace_path)
    window = decode_step_window(trace)
    if window is None:
        return None
    t0, t1 = window
    names = timeline.track_names(trace)
    tids = sorted(names)
    colors = {"read": "tab:red", "prefetch": "tab:orange", "stall": "tab:gray",
              "install": "tab:purple", "sample": "tab:green", "decode-step": "lightsteelblue"}
    fig, ax = plt.subplots(figsize=(11, 0.5 + 0.45 * len(tids)))
    for row, tid in enumerate(tids):
        for e in trace["traceEvents"]:
            if e.get("ph") != "X" or e["tid"] != tid or e["ts"] + e["dur"] < t0 or e["ts"] > t1:
                continue
            start, end = max(e["ts"], t0), min(e["ts"] + e["dur"], t1)
            color = colors.get(e["name"], "tab:blue")
            height = 0.8 if e["name"] != "decode-step" else 0.95
            ax.broken_barh([((start - t0) / 1000, (end - start) / 1000)], (row - height / 2, height),
                           facecolors=color, edgecolor="none")
    ax.set_yticks(range(len(tids)))
    ax.set_yticklabels([names[t] for t in tids])
    ax.invert_yaxis()
    ax.set_xlabel("ms into the decode step")
    ax.set_title(title or "one decode step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (*colors.values(), "tab:blue")]
    ax.legend(handles, [*colors.keys(), "MLX call"], loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


