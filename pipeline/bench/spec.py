"""What one bench case is (sent to its worker process as JSON) and what it measured."""

from __future__ import annotations

import random
from typing import Any

import msgspec

from pipeline.bench.read_path import ReadPath

Kind = str  # "moestream" | "resident" | "io"


class Case(msgspec.Struct, kw_only=True):
    """One configuration to measure (sent to the worker process as JSON)."""

    name: str
    model: str
    kind: Kind = "moestream"
    config: dict[str, Any] = {}  # PipelineConfig sections over the defaults
    prompt_tokens: int = 16
    max_tokens: int = 32
    cold: bool = True
    trace: str | None = None
    seed: int = 0
    # warm-all: a pool of every expert, read in before measuring (decode never waits for
    # the disk), then mlx-lm fully resident in the same process as the reference.
    warm_all: bool = False
    # Who picks the experts: "router" (the container's), "calibrated" or "calibrated-gate"
    # (the routing model's ids, benchmark only; see pipeline/bench/routing.py).
    routing: str = "router"
    concurrency: int = 0  # batch cases (pipeline/bench/batch.py): sequences decoding at once
    # Speculative cases (pipeline/bench/speculative.py): drafts from `reference`'s tokens
    # (`draft_reference`, filled in once it ran) with acceptance `emulate`; None: the
    # configured drafter's own.
    emulate: float | None = None
    reference: str = ""
    draft_reference: list[int] = []


class Result(msgspec.Struct, kw_only=True):
    name: str
    kind: Kind
    prompt_tokens: int = 0
    max_tokens: int = 0
    completion_tokens: int = 0
    decode_tok_s: float = 0.0
    prefill_tok_s: float = 0.0
    ttft_s: float = 0.0
    peak_rss_mb: float = 0.0
    peak_device_mb: float = 0.0
    decode_rss_mb: float = 0.0
    decode_device_mb: float = 0.0
    pool_mb: float = 0.0
    slots: int = 0
    readers: int = 0
    readers_prefill: int = 0  # disk threads reading a prompt (readers = auto's bulk lane)
    reader_io: str = ""  # how reads reached the disk: threads or uring (reader.io, as it ran)
    strategy: str = ""
    eviction: str = ""
    overlap: bool = True
    o_direct: bool = False
    device_copy: str = ""  # how blobs reached the pool (host, direct, load, prefetch)
    hit_rate: float = 0.0
    decode_hit_rate: float = 0.0
    bytes_read_per_token: float = 0.0
    decode_bytes_per_token: float = 0.0
    prefetch_precision: float = 0.0
    prefetch_recall: float = 0.0
    stall_fraction: float = 0.0
    read_gb_s: float = 0.0  # "io" only
    # OS threads after the generation: each thread that ever touched MLX leaves a stream
    # (and on Linux a thread) behind, so growth here means something leaks them.
    os_threads: int = 0
    # After the generation: the kernel's split of RSS, and the largest mappings by RSS.
    rss_kinds: dict[str, float] = {}
    rss_by_mapping: dict[str, float] = {}
    open_s: float = 0.0  # engine open (dense core, pool), then the warm-up generation:
    warmup_s: float = 0.0  # where a case's time goes besides the measured generation
    prefill_chunk: int = 0
    prefill_bytes: int = 0  # expert bytes read before the first decode step
    run_ahead_tokens: int = 0  # decode tokens that tried one sync per token ...
    run_ahead_misses: int = 0  # ... and fell back to one per layer
    ahead_steps: int = 0  # decode steps queued second (every expert pooled, a lone row)
    awaited_tokens: int = 0  # decode tokens queued whole, waiting on the GPU (device_wait)
    resident_decode_tok_s: float = 0.0  # warm-all: mlx-lm resident, same process
    # warm-all: (resident, engine) runs alternating beside each other (bench/warm_pairs.py).
    paired_engine_tok_s: list[float] = []
    paired_resident_tok_s: list[float] = []
    # warm-spec-*: (plain, speculative) runs alternating in the case's engine (the same file).
    paired_plain_tok_s: list[float] = []
    paired_spec_tok_s: list[float] = []
    memory: dict[str, float | None] = {}  # the peak's split (pipeline/memory_breakdown.py)
    # Batch cases: decode_tok_s is the aggregate over the rows.
    concurrency: int = 0
    per_seq_ms_per_token: float = 0.0  # the slowest row's
    per_seq_ms_per_token_mean: float = 0.0
    batch_rows_per_step: float = 0.0
    # Cold cases: where the decode window's time went on the read path.
    read_path: ReadPath | None = None
    queue_depth_gb_s: dict[int, float] = {}  # readers = auto: the probe's depth -> GB/s
    token_ids: list[int] = []  # the measured generation's (speculative cases draft from them)
    # Speculative cases: the mode, the emulated acceptance (None: a real drafter's), the
    # longest draft, and what the passes did.
    speculative: str = "off"
    emulated_acceptance: float | None = None
    draft_tokens: int = 0
    verify_passes: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    acceptance: float = 0.0
    tokens_per_pass: float = 0.0
    backend: str = ""
    routing: str = "router"  # what chose the experts (a calibrated label: benchmark only)
    seconds: float = 0.0
    error: str | None = None


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    """A fixed random prompt of ordinary tokens (below the special-token range)."""
    rng = random.Random(seed)
    return [rng.randrange(100, min(vocab, 150_000)) for _ in range(n)]


def backend() -> str:
    import mlx.core as mx

    return str(mx.default_device())


def every_expert_slots(model: str) -> int:
    """Pool slots for every routed expert of the container `model` (a warm-all pool)."""
    from qpack.reader import Container

    with Container.open(model, verify="off") as c:
        return c.manifest.num_experts * len(c.manifest.layers)


def engine_dict(case: Case) -> dict[str, Any]:
    raw: dict[str, Any] = {k: dict(v) for k, v in case.config.items()}
    raw.setdefault("model", {})["path"] = case.model
    raw["model"].setdefault("verify", "off")
    if case.warm_all:
        raw["pool"] = {**{k: v for k, v in raw.get("pool", {}).items() if k != "budget_mb"},
                       "slots": every_expert_slots(case.model)}
    return raw
