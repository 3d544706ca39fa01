"""Pipeline- vs expert-parallel streaming over N hosts, simulated from routing traces.

    python benchmarks/parallel_sim.py [--trace T.json.gz] [--hosts 1,2,4,8] [--out sim.json]

Replays the decode steps of a routing trace (a recorded one, `moestream generate
--record-routing`, or by default the calibrated routing model's Qwen3-Next-80B workload,
docs/routing.md) through one LRU expert pool per host, and turns each token's
misses into time with a simple cost model (all times per decode token, one sequence):

- pipeline (PP, what pipeline/distributed does): host h runs layers [hL/N, (h+1)L/N) and
  caches their experts. A token visits the hosts in turn, so its reads are the sum over
  layers of misses x expert bytes / disk bandwidth, on one disk at a time; the boundary
  costs N one-way latencies plus the hidden states and the logits over the link.
- expert-parallel (EP): host h owns the experts e with e mod N == h of every layer and
  caches those; host 0 runs the dense core. Every MoE layer sends the hidden state to the
  owners and gathers their outputs: one round trip per layer, but a layer's misses are
  read by N disks at once (the slowest host sets the pace). Over an all-to-all (what EP
  needs): 2 latencies per layer. Over MLX's collectives (no all-to-all; the ring backend
  sends only to neighbours): an all_gather plus an all_sum around the ring, 3(N-1)
  latencies per layer.
Compute per layer is a constant (default: the H200's resident 80B decode, 22 tok/s over
48 layers); reads are not overlapped with compute (what a miss costs when prefetch is
wrong or late), the same in every mode, so the modes compare fairly.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.routing_model.workload import Workload, workload_trace  # noqa: E402
from actors.routing_trace import RoutingTrace, load_trace  # noqa: E402


class LRU:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.keys: OrderedDict[tuple[int, int], None] = OrderedDict()

    def access(self, key: tuple[int, int]) -> bool:
        """Whether `key` was there (then it is the most recent); inserts it if not."""
        if key in self.keys:
            self.keys.move_to_end(key)
            return True
        self.keys[key] = None
        if len(self.keys) > self.slots:
            self.keys.popitem(last=False)
        return False


def misses(trace: RoutingTrace, hosts: int, mode: str, slots: int) -> tuple[list[list[list[int]]], float]:
    """Per decode step, per layer, per host: misses; and the decode hit rate. Prefill
    steps warm the pools (as they do live) but are not counted."""
    layers = trace.model.moe_layers
    pools = [LRU(slots) for _ in range(hosts)]
    span = -(-len(layers) // hosts)
    owner_of_layer = {layer: min(i // span, hosts - 1) for i, layer in enumerate(layers)}
    out: list[list[list[int]]] = []
    hits = total = 0
    for step in trace.steps:
        decode = step.phase == "decode"
        row = []
        for entry in step.layers:
            per_host = [0] * hosts
            for e in entry.chosen:
                h = owner_of_layer[entry.layer] if mode == "pp" else e % hosts
                hit = pools[h].access((entry.layer, e))
                per_host[h] += not hit
                hits += hit and decode
                total += decode
            row.append(per_host)
        if decode:
            out.append(row)
    return out, hits / max(total, 1)


def token_seconds(row: list[list[int]], mode: str, hosts: int, a: argparse.Namespace,
                  scale: float, stride: int) -> tuple[float, float]:
    """(seconds, bytes on the critical path) of one decode token, scaled to full depth."""
    read = stride / (a.disk_gbs * 1e9)
    lat = a.latency_us * 1e-6
    link = a.link_gbs * 1e9
    compute = a.layer_ms * 1e-3 * len(row)
    if mode == "pp":
        reads = sum(sum(layer) for layer in row) * read
        comm = 0.0 if hosts == 1 else hosts * lat + ((hosts - 1) * a.hidden * 2 + a.vocab * 4) / link
        return (compute + reads) * scale + comm, sum(map(sum, row)) * stride * scale
    slowest = sum(max(layer) for layer in row)
    per_layer = 0.0
    if hosts > 1:
        payload = 2 * a.hidden * 2 * a.top_k / link  # hidden states out, expert outputs back
        hops = 2 if mode == "ep" else 3 * (hosts - 1)
        per_layer = hops * lat + payload
    return (compute + slowest * read + per_layer * len(row)) * scale, slowest * stride * scale


def simulate(trace: RoutingTrace, a: argparse.Namespace) -> list[dict[str, Any]]:
    full = a.full_layers or trace.model.num_layers
    scale = full / len(trace.model.moe_layers)  # a shallow trace stands for the whole model
    stride = trace.model.stride
    # The per-host pool, cut to the trace's depth: the same slots per layer as the full model.
    slots = max(1, int(a.pool_gib * 2**30 / stride / scale))
    rows = []
    for hosts in a.hosts:
        for mode in ("pp", "ep", "ep-mlx-ring"):
            if hosts == 1 and mode != "pp":
                continue
            per_token, hit_rate = misses(trace, hosts, "pp" if mode == "pp" else "ep", slots)
            timed = [token_seconds(r, mode, hosts, a, scale, stride) for r in per_token]
            seconds = sum(t for t, _ in timed) / len(timed)
            rows.append({"hosts": hosts, "mode": mode, "hit_rate": round(hit_rate, 4),
                         "critical_read_mb_per_token": round(sum(b for _, b in timed) / len(timed) / 1e6, 1),
                         "tok_s": round(1 / seconds, 3)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, help="a recorded routing trace (default: the model's)")
    p.add_argument("--family", default="qwen3-next-80b")
    p.add_argument("--trace-layers", type=int, default=16, help="layers of the generated trace")
    p.add_argument("--full-layers", type=int, default=48, help="the model's depth (time scales to it)")
    p.add_argument("--hosts", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--pool-gib", type=float, default=8.0, help="expert pool per host")
    p.add_argument("--disk-gbs", type=float, default=2.0, help="read bandwidth per host")
    p.add_argument("--latency-us", type=float, default=50.0, help="one-way link latency")
    p.add_argument("--link-gbs", type=float, default=1.25, help="link bandwidth (10 GbE)")
    p.add_argument("--layer-ms", type=float, default=45.0 / 48, help="compute per layer")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="latency x disk grid (markdown)")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    trace = load_trace(a.trace) if a.trace else workload_trace(
        Workload(family=a.family, layers=a.trace_layers), policy="lru")
    results: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                               "runs": []}
    grid = [(lat, disk) for lat in (5.0, 50.0, 500.0) for disk in (0.5, 2.0, 7.0)] if a.sweep \
        else [(a.latency_us, a.disk_gbs)]
    for lat, disk in grid:
        a.latency_us, a.disk_gbs = lat, disk
        for row in simulate(trace, a):
            results["runs"].append({"latency_us": lat, "disk_gbs": disk, **row})
            print(json.dumps(results["runs"][-1]), flush=True)
    if a.out:
        a.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
