"""Routing traces from the routing model: workloads for `moestream replay` and the benchmarks.

A workload is a few requests in turn, each a prompt (prefilled in chunks) then generated
tokens, each request in a prompt domain: by default the domains alternate, so every
request after the first shifts the hot sets (what a server with mixed traffic sees). The
trace has the same form as one recorded live (actors/routing_trace.py): per-token rows at
prefill, and at decode steps the emulated gate-ahead predictions (recorded as strategy
"next-gate", labelled `emulated` in its params), so `replay --strategies next-gate` (or
`recorded`) replays them and the statistics strategies rerun as they would live.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np

from actors.bounds import convert_bounded
from actors.routing_model.families import FAMILIES, STRIDES
from actors.routing_model.model import RoutingModel, RoutingParams, RoutingShape
from actors.routing_trace import RoutingTrace, TraceModel, TracePool, TraceRecorder


def _in(lo: int, hi: int) -> msgspec.Meta:
    return msgspec.Meta(ge=lo, le=hi)


# A trace holds every (token, layer) step, so its size is bounded: each count on its own
# and their product, requests x (prompt + decode) tokens (the default: 4 x 364).
MAX_TOKENS = 1 << 16


class Workload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    family: str = "qwen3-next-80b"
    requests: Annotated[int, _in(1, 1024)] = 4
    prompt_tokens: Annotated[int, _in(0, MAX_TOKENS)] = 64
    decode_tokens: Annotated[int, _in(1, MAX_TOKENS)] = 300  # the published Next curve's generation length
    prefill_chunk: Annotated[int, _in(1, MAX_TOKENS)] = 16
    domains: Annotated[int, _in(1, 1024)] = 2  # requests cycle through this many prompt domains
    layers: Annotated[int, _in(0, 1024)] = 0  # 0 = the family's layer count; fewer = a cheaper, shallower trace
    seed: Annotated[int, _in(0, (1 << 63) - 1)] = 0


def parse_workload(text: str) -> Workload:
    """`FAMILY[,key=value...]`, e.g. `qwen3-next-80b,requests=2,seed=3`."""
    name, *pairs = [t.strip() for t in text.split(",") if t.strip()] or [""]
    if name not in FAMILIES:
        raise ValueError(f"unknown workload family {name!r}; valid: {', '.join(FAMILIES)}")
    fields: dict[str, object] = {"family": name}
    valid = [f for f in Workload.__struct_fields__ if f != "family"]
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in valid or not value.lstrip("-").isdigit():
            raise ValueError(f"workload {text!r}: bad setting {pair!r}; keys: {', '.join(valid)}")
        fields[key] = int(value)
    w: Workload = convert_bounded(fields, Workload, f"workload {text!r}")
    tokens = w.requests * (w.prompt_tokens + w.decode_tokens)
    if tokens > MAX_TOKENS:
        raise ValueError(f"workload {text!r}: requests x (prompt_tokens + decode_tokens) is "
                         f"{tokens}, more than {MAX_TOKENS} tokens in all")
    return w


def workload_trace(
    w: Workload,
    *,
    num_slots: int = 0,
    policy: str = "lru",
    params: RoutingParams | None = None,
    shape: RoutingShape | None = None,
    stride: int = 0,
    depths: list[float] | None = None,
) -> RoutingTrace:
    """Generate the workload's routing as a trace (num_slots 0 = a tenth of all experts).

    `params` replaces the family's fitted parameters (e.g. all zero: uniform routing);
    `shape` and `stride` another model's experts, top-k and expert bytes (a container's,
    routed with this family's parameters); `depths` the layers' relative depths (see
    RoutingModel)."""
    family_shape, fitted = FAMILIES[w.family]
    shape = shape or family_shape
    params = params or fitted
    layers = w.layers or shape.num_layers
    shape = RoutingShape(shape.name, min(layers, shape.num_layers), shape.num_experts, shape.top_k)
    model = RoutingModel(shape, params, seed=w.seed, depths=depths)
    L, E = shape.num_layers, shape.num_experts
    trace_model = TraceModel(
        num_layers=L, moe_layers=list(range(L)), num_experts=E, top_k=shape.top_k,
        stride=stride or STRIDES[w.family],
    )
    pool = TracePool(
        num_slots=num_slots or max(1, L * E // 10),
        policy=policy,
        strategy="next-gate",
        strategy_params={"emulated": f"routing model {w.family}, gate_noise {params.gate_noise}, "
                                   f"gate_share {params.gate_share}"},
    )
    rec = TraceRecorder(trace_model, pool)
    rng = np.random.default_rng([w.seed, 0xC0FFEE])
    for r in range(w.requests):
        ids, gates = model.tokens(r % w.domains, w.prompt_tokens + w.decode_tokens, rng, gate=True)
        assert gates is not None
        for start in range(0, w.prompt_tokens, w.prefill_chunk):
            rows = ids[start : min(start + w.prefill_chunk, w.prompt_tokens)]
            rec.begin_token("prefill")
            for layer in range(L):
                chunk = rows[:, layer]
                chosen = list(dict.fromkeys(int(e) for e in chunk.reshape(-1)))
                rec.record(layer, chosen, (), tokens=chunk.tolist())
        for t in range(w.prompt_tokens, w.prompt_tokens + w.decode_tokens):
            rec.begin_token("decode")
            for layer in range(L):
                preds = [(layer + 1, gates[t, layer + 1].tolist())] if layer + 1 < L else []
                rec.record(layer, ids[t, layer].tolist(), preds)
    return rec.trace
