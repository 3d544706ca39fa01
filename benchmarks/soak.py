"""Soak: mixed traffic against a real `moestream serve` for a long time, resources sampled.

    python benchmarks/soak.py [--container demo-data/demo.qpack] [--minutes 30]
                              [--sample-s 60] [--clients 3] [--json OUT]

Starts `moestream serve C --config config/demo.toml` as a process of its own, then
`--clients` tasks send a seeded mix through the official openai and anthropic clients
(chat, completions, streaming, forced tool calls, JSON-schema grammar, Responses,
Anthropic messages) plus cancels (a stream closed after two chunks) and disconnects (a
raw socket dropped mid-stream). Every `--sample-s` the traffic is paused, the server
left to go idle, and the server process sampled: RSS, open files (sockets apart: the
clients' keep-alive connections come and go), threads, and from
/metrics the pool's pinned experts, reads in flight, queue depth and running
generations. Each sample is taken idle, so after warm-up they should read the same: RSS
flat (its least-squares slope at most --max-rss-slope MiB/hour), open files, sockets and
threads not growing (trio's idle worker threads come and go), nothing pinned, nothing
in flight. Outcomes are counted per kind; anything but a whole reply (or
the cancel / disconnect the traffic asked for) is an unexpected error, and the run says
FAIL. The summary goes to stdout and, with --json, to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import trio
from soak_traffic import Traffic

REPO = Path(__file__).resolve().parents[1]
GAUGES = ("pool_pinned_experts", "pool_loads_in_flight", "queue_depth", "running_generations",
          "generations_total", "expert_reads_total", "heap_trimmed_bytes_total",
          "prefix_cache_entries", "prefix_cache_bytes")


def _metrics(port: int) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("moestream_") and "{" not in line:
            name, value = line.split()
            out[name.removeprefix("moestream_")] = float(value)
    return out


def _health(port: int) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


async def _sample(proc: psutil.Process, port: int, t0: float) -> dict[str, Any]:
    """Once the server is idle (nothing running or queued): its resources and gauges."""
    with trio.fail_after(120):
        while True:
            m = await trio.to_thread.run_sync(_metrics, port)
            if m.get("running_generations", 1) == 0 and m.get("queue_depth", 1) == 0:
                break
            await trio.sleep(0.2)
    await trio.sleep(0.5)  # the last reply's clean-up (prefetch settle, heap trim)
    m = await trio.to_thread.run_sync(_metrics, port)
    fds = proc.num_fds()
    # The clients' keep-alive connections come and go with their pools: counted apart,
    # so that what must stay flat (files, pipes, epoll, eventfds) is seen on its own.
    sockets = len(proc.net_connections(kind="inet"))
    return {"minute": round((time.monotonic() - t0) / 60, 2),
            "rss_mb": round(proc.memory_info().rss / 2**20, 1),
            "open_files": fds - sockets, "sockets": sockets, "threads": proc.num_threads(),
            "fd_kinds": _fd_kinds(proc.pid),
            "health": await trio.to_thread.run_sync(_health, port),
            **{g: m.get(g) for g in GAUGES}}


def _fd_kinds(pid: int) -> dict[str, int]:
    """The process's descriptors by what they point at (Linux: /proc/PID/fd), so that a
    count that grew says what grew: a file by its path, else its kind (socket, pipe,
    anon_inode:[eventfd], ...). {} where /proc is not there."""
    kinds: Counter[str] = Counter()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return {}
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:  # closed since the listing
            continue
        kinds[target.split(":[", 1)[0]] += 1  # "socket:[1234]" -> "socket"; a path stays whole
    return dict(sorted(kinds.items()))


def _fd_change(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What a later sample holds more (or fewer) of than an earlier one."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(before.keys() | after.keys())
            if after.get(k, 0) != before.get(k, 0)}


def _grows(values: list[float]) -> bool:
    """Whether the later half of a series stays above everything the earlier half saw: a
    leak raises the floor; a count that comes and goes (trio's idle worker threads, a
    file open for a moment) does not."""
    half = len(values) // 2
    return half > 0 and min(values[half:]) > max(values[:half])


def _slope_mb_per_hour(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx_ = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx_) ** 2 for x, _ in points)
    return 0.0 if var == 0 else 60 * sum((x - mx_) * (y - my) for x, y in points) / var


async def soak(args: argparse.Namespace, proc: psutil.Process, port: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    traffic = Traffic(port, rng)
    weights = {"chat": 3, "chat_stream": 3, "completion": 2, "completion_stream": 2, "tools": 1,
               "grammar": 1, "responses": 1, "anthropic": 1, "anthropic_stream": 1, "cancel": 1,
               "disconnect": 1}
    names, w = list(weights), list(weights.values())
    outcomes: dict[str, Counter[str]] = {k: Counter() for k in names}
    errors: list[str] = []
    samples: list[dict[str, Any]] = []
    go = trio.Event()
    go.set()
    active = [0]
    t0 = time.monotonic()
    end = t0 + args.minutes * 60

    async def client(i: int) -> None:
        while time.monotonic() < end:
            await go.wait()
            kind = rng.choices(names, w)[0]
            active[0] += 1
            try:
                await getattr(traffic, kind)()
                outcomes[kind]["ok"] += 1
            except Exception as exc:  # noqa: BLE001 - counted and reported, the soak goes on
                outcomes[kind][type(exc).__name__] += 1
                errors.append(f"{time.monotonic() - t0:.0f}s {kind}: {type(exc).__name__}: {str(exc)[:200]}")
            finally:
                active[0] -= 1

    async def sampler() -> None:
        nonlocal go
        while True:
            await trio.sleep(args.sample_s)
            go = trio.Event()  # new requests wait; those in flight finish
            with trio.fail_after(600):
                while active[0]:
                    await trio.sleep(0.1)
            sample = await _sample(proc, port, t0)
            samples.append(sample)
            print(json.dumps(sample), flush=True)
            go.set()
            if time.monotonic() >= end:
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sampler)
        for i in range(args.clients):
            nursery.start_soon(client, i)
    warm = [s for s in samples if s["minute"] >= args.warmup_min] or samples[-1:]
    rss = [s["rss_mb"] for s in warm]
    flat = {k: sorted({s[k] for s in warm}) for k in ("open_files", "sockets", "threads",
                                                      "pool_pinned_experts", "pool_loads_in_flight")}
    unexpected = sum(n for c in outcomes.values() for k, n in c.items() if k != "ok")
    slope = _slope_mb_per_hour([(s["minute"], s["rss_mb"]) for s in warm])
    # The prefix cache fills up to its bound (16 prompt states, pipeline/prefix_cache.py)
    # while the traffic brings new prompts: RSS grows with it until it is full. The slope of
    # RSS less what it holds is the process's own.
    less = _slope_mb_per_hour([(s["minute"], s["rss_mb"] - (s.get("prefix_cache_bytes") or 0) / 2**20)
                               for s in warm])
    growing = [k for k in ("open_files", "threads") if _grows([s[k] for s in warm])]
    ok = (unexpected == 0 and all(s["health"] == 200 for s in samples)
          and flat["pool_pinned_experts"] == [0] and flat["pool_loads_in_flight"] == [0]
          and not growing and slope <= args.max_rss_slope
          and max(s["sockets"] for s in warm) <= 1 + 4 * args.clients)  # listener + pools
    return {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "minutes": args.minutes,
            "clients": args.clients, "seed": args.seed, "container": str(args.container),
            "requests": sum(sum(c.values()) for c in outcomes.values()),
            "outcomes": {k: dict(c) for k, c in outcomes.items()}, "errors": errors[:50],
            "unexpected_errors": unexpected, "samples": samples,
            "after_warmup": {"from_minute": args.warmup_min, "rss_mb_min": min(rss), "rss_mb_max": max(rss),
                             "rss_slope_mb_per_hour": round(slope, 2),
                             "rss_less_prefix_cache_slope_mb_per_hour": round(less, 2),
                             "prefix_cache_mb_max": round(max((s.get("prefix_cache_bytes") or 0)
                                                              for s in warm) / 2**20, 1),
                             "growing": growing,
                             # what the last sample holds beyond the first one after warm-up
                             "fd_change": _fd_change(warm[0].get("fd_kinds", {}),
                                                     warm[-1].get("fd_kinds", {})),
                             **flat},
            "verdict": "PASS" if ok else "FAIL"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--container", type=Path, default=REPO / "demo-data" / "demo.qpack")
    p.add_argument("--config", type=Path, default=REPO / "config" / "demo.toml")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--sample-s", type=float, default=60.0)
    p.add_argument("--warmup-min", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-slope", type=float, default=64.0,
                   help="MiB per hour of RSS growth after warm-up that still passes")
    p.add_argument("--json", type=Path, help="write the summary here")
    p.add_argument("--server-log", type=Path, help="the server's stderr (default: discarded)")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL  # noqa: SIM115
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "serve", str(args.container), "--config", str(args.config),
         "--port", str(port), "--max-queue", str(args.clients * 2)],
        cwd=REPO, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 600
        while _health(port) != 200:
            if server.poll() is not None or time.monotonic() > deadline:
                print(f"error: the server did not come up (exit {server.poll()})", file=sys.stderr)
                return 1
            time.sleep(0.5)
        result = trio.run(soak, args, psutil.Process(server.pid), port)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = server.wait()
    result["server_exit"] = code
    if code != 0:
        result["verdict"] = "FAIL"
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
