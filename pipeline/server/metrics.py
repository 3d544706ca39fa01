"""Server metrics in the Prometheus text exposition format (no client library needed).

Counters live here and are bumped by the server; gauges that belong to the engine
(queue depth, pool bytes, pool hit rate, memory) are read from it when scraped.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pipeline.events import GenerationStats
from pipeline.resident_map import current_rss_mb

if TYPE_CHECKING:
    from pipeline.engine import Engine

PREFIX = "moestream"


class Metrics:
    def __init__(self) -> None:
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.last_decode_tok_s = 0.0
        self.last_ttft_s = 0.0
        self.last_decode_rss_mb = 0.0
        self.last_decode_device_mb = 0.0
        self.requests: Counter[tuple[str, int]] = Counter()

    def record_request(self, path: str, status: int) -> None:
        self.requests[(path, status)] += 1

    def record_generation(self, stats: GenerationStats) -> None:
        self.tokens_generated += stats.completion_tokens
        self.prompt_tokens += stats.prompt_tokens
        self.cached_tokens += stats.cached_tokens
        self.last_decode_tok_s = stats.decode_tok_s
        self.last_ttft_s = stats.ttft_s
        self.last_decode_rss_mb = stats.decode_rss_mb
        self.last_decode_device_mb = stats.decode_device_mb

    def render(self, engine: Engine) -> str:
        pool = engine.pool_snapshot()
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            full = f"{PREFIX}_{name}"
            lines.append(f"# HELP {full} {help_}")
            lines.append(f"# TYPE {full} {kind}")
            for labels, value in samples:
                lines.append(f"{full}{labels} {_num(value)}")

        metric("tokens_generated_total", "counter", "Completion tokens generated.",
               [("", self.tokens_generated)])
        metric("prompt_tokens_total", "counter", "Prompt tokens received.", [("", self.prompt_tokens)])
        metric("cached_prompt_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
               [("", self.cached_tokens)])
        metric("decode_tokens_per_second", "gauge", "Decode speed of the last finished request.",
               [("", self.last_decode_tok_s)])
        metric("time_to_first_token_seconds", "gauge", "TTFT of the last finished request.",
               [("", self.last_ttft_s)])
        metric("queue_depth", "gauge", "Requests waiting for the engine.", [("", engine.waiting)])
        metric("batch_size", "gauge", "Sequences in the decode batch now.", [("", pool["batch_size"])])
        metric("running_generations", "gauge", "Generations admitted (prefilling or decoding).",
               [("", engine.running)])
        metric("batch_steps_total", "counter", "Decode batch steps.", [("", pool["batch_steps"])])
        metric("batch_rows_stepped_total", "counter",
               "Sequence-steps decoded (batch size summed over steps).",
               [("", pool["batch_rows_stepped"])])
        metric("pool_bytes", "gauge", "Bytes of the expert pool.", [("", pool["pool_bytes"])])
        metric("pool_slots", "gauge", "Expert slots in the pool.", [("", pool["slots"])])
        metric("pool_resident_experts", "gauge", "Experts resident in the pool.",
               [("", pool["resident"])])
        # Both 0 whenever the server is idle: what a long-running server's soak watches.
        metric("pool_pinned_experts", "gauge", "Experts pinned by a forward pass now.",
               [("", pool["pinned"])])
        metric("pool_loads_in_flight", "gauge", "Expert reads issued and not yet installed.",
               [("", pool["loads_in_flight"])])
        metric("pool_hit_rate", "gauge", "Expert pool hit rate since the engine opened.",
               [("", pool["hit_rate"])])
        metric("generations_total", "counter", "Generations finished or cancelled.",
               [("", pool["generations"])])
        metric("expert_reads_total", "counter", "Expert blobs read from the container.",
               [("", pool["expert_reads"])])
        metric("expert_read_bytes_total", "counter", "Bytes of expert blobs read.",
               [("", pool["expert_read_bytes"])])
        metric("read_stall_seconds_total", "counter", "Time compute waited on expert reads.",
               [("", pool["stall_seconds"])])
        metric("prefetch_hits_waited_total", "counter",
               "Demanded experts whose prefetch was still loading.", [("", pool["prefetch_hits_waited"])])
        metric("prefetch_shelved_total", "counter",
               "Predicted reads taken off the queue unread: their layer was routed without them.",
               [("", pool["prefetch_shelved"])])
        metric("mlx_seconds_total", "counter", "Time spent in MLX calls (forward, sampling).",
               [("", pool["mlx_seconds"])])
        for name, help_ in _SPECULATION:
            metric(f"{name}_total", "counter", help_, [("", pool[name])])
        mib = 2**20
        metric("resident_memory_bytes", "gauge", "Host RSS of the server process now.",
               [("", round(current_rss_mb() * mib))])
        metric("decode_resident_memory_bytes", "gauge",
               "Host RSS while the last finished request decoded (its peak).",
               [("", round(self.last_decode_rss_mb * mib))])
        metric("decode_device_memory_bytes", "gauge",
               "MLX memory while the last finished request decoded (its peak).",
               [("", round(self.last_decode_device_mb * mib))])
        # Bounded by `prefix_cache.max_entries` / `max_bytes`: a soak's RSS grows by what it
        # holds until it is full (benchmarks/soak.py sets the two apart).
        entries, held = engine.prefix_cache.usage()
        metric("prefix_cache_entries", "gauge", "Prompt states kept for prefix reuse.", [("", entries)])
        metric("prefix_cache_bytes", "gauge", "Bytes of the prompt states kept for prefix reuse.",
               [("", held)])
        metric("heap_trimmed_bytes_total", "counter",
               "Freed host memory handed back to the OS after generations (malloc_trim).",
               [("", round(engine.trimmed_mb * mib))])
        metric("requests_total", "counter", "HTTP requests by path and status.",
               [(f'{{path="{_escape(p)}",status="{s}"}}', n)
                for (p, s), n in sorted(self.requests.items())])
        return "\n".join(lines) + "\n"


# Speculative decoding (docs/speculative.md): acceptance = accepted / proposed, tokens
# per pass = pass_tokens / verify_passes.
_SPECULATION = (
    ("verify_passes", "Speculative verify passes."),
    ("drafts_proposed", "Drafted tokens verified."),
    ("drafts_accepted", "Drafted tokens kept."),
    ("pass_tokens", "Tokens the verify passes produced (drafts kept, one more each)."),
    ("speculative_backoffs", "Times speculative = auto stopped speculating."),
    ("shadow_drafts", "Plain steps at which speculative = auto compared a draft with the step's token."),
)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
