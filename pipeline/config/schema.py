"""The pipeline config: typed sections decoded from TOML, with errors that name key and line.

Only `[model].path` is required; every other key has a default, so a two-line file runs.
Relative paths (model.path, run.stats, ...) are taken relative to the current working
directory, not the config file, so that `config/*.toml` can name `demo-data/...` and
work from the repository root.

`load_config(path, overrides)` (pipeline.config.loading) parses with tomllib, applies `section.key=value` overrides
(values in TOML syntax, falling back to a plain string), checks for unknown keys (with a
difflib suggestion), then decodes with `msgspec.convert(strict=True)`. Every failure is a
`ConfigError` naming the file, the dotted key and the line (or the override it came from).
The error wording lives in pipeline.config_errors, the TOML writer in pipeline.config_toml.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from actors.pool.eviction import POLICY_NAMES
from actors.prefetch import STRATEGY_NAMES
from pipeline.config.errors import one_of
from pipeline.config.sampling import ChatConfig, SamplingConfig
from pipeline.config.toml import drop_none, dumps_toml

# The names the pool and the prefetcher know, from their own registries.
EVICTION_POLICIES: tuple[str, ...] = POLICY_NAMES
PREFETCH_STRATEGIES: tuple[str, ...] = STRATEGY_NAMES

LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error")
SYNTH_PREFIX = "synth:"

# Each reader is a thread with staging buffers: past the deepest NVMe queue, only memory.
MAX_READERS = 256


def within(lo: float, hi: float, *, open_low: bool = False) -> msgspec.Meta:
    """A knob's range, [lo, hi] (or (lo, hi]): every knob has one, so that no value from a
    file, `--set` or a dict can ask for unbounded memory or time; the error names it
    (actors.bounds). NaN and inf fail either bound."""
    return msgspec.Meta(gt=lo, le=hi) if open_low else msgspec.Meta(ge=lo, le=hi)


MIB_MAX = 1 << 24  # 16 TiB in MiB: above any machine's memory, far below int64
TOKENS_MAX = 1 << 20  # a million tokens: above any context length these models have


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A config section. msgspec passes `frozen` on to subclasses; each section says it
    again all the same, because type checkers read a subclass without it as mutable."""


class ModelConfig(_Section, frozen=True):
    # A `.qpack` directory, or `synth:<preset>` (synthesize and pack the preset on first use).
    path: str
    # Hub id, checkpoint directory or `synth:<preset>` to pack `path` from when it is missing.
    source: str | None = None
    # Checksums: "off", "first-use" (each expert once, when first read), "full" (everything
    # at open) or "always" (every read: catches a flip on a re-read, costs a crc32 pass).
    verify: Literal["off", "first-use", "full", "always"] = "first-use"

    def __post_init__(self) -> None:
        for name, value in (("path", self.path), ("source", self.source)):
            if value is not None and value.strip() in ("", SYNTH_PREFIX):
                raise ValueError(f"{name} must name a container or a synth:<preset>, got {value!r}")


class PoolConfig(_Section, frozen=True):
    # Give budget_mb or slots, or neither (derive from the memory left after the dense core).
    budget_mb: Annotated[int, within(1, MIB_MAX)] | None = None
    slots: Annotated[int, within(1, 1 << 24)] | None = None
    # "reuse" (actors/pool/eviction_scored.py): on calibrated routing it had the smallest
    # loss to the best policy at each pool size (mean 2.1, worst 5.8 points over 3 model
    # shapes x 6-7 sizes); LFU with the decay below lost up to 42 points at small pools.
    # docs/routing.md, benchmarks/results/routing/.
    eviction: str = "reuse"
    # LFU counts fade by this factor every `lfu_period` pool accesses (1.0 = plain LFU);
    # the parameters of actors.eviction.LFUDecay, ignored by the other policies.
    lfu_decay: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.9
    lfu_period: Annotated[int, within(1, 1 << 30)] = 512
    # The MTP head's experts have a pool of their own (docs/speculative.md); unset: the
    # same share of its experts as the pool holds of the model's, taken from its bytes.
    mtp_slots: Annotated[int, within(1, 1 << 24)] | None = None
    # At most this many slots in one bank (actors/pool/banks.py: a pool larger than the
    # expert kernels index right is cut into banks, each layer's experts in one). 0: the
    # most they index right for this model; a larger value is lowered to that.
    bank_slots: Annotated[int, within(0, 1 << 24)] = 0

    def __post_init__(self) -> None:
        if self.budget_mb is not None and self.slots is not None:
            raise ValueError("slots and budget_mb are exclusive: set one, or neither to derive")
        one_of("eviction", self.eviction, EVICTION_POLICIES)


class MemoryConfig(_Section, frozen=True):
    """One total budget for the process (docs/memory.md): the pool gets what is left of it."""

    # MiB the whole process may take (RSS). Set: the engine subtracts what it measured (the
    # process with its tokenizer, the dense core) and what it reserves (model state, staging
    # buffers, MLX temporaries) and sizes the pool from the rest; too small a budget is
    # refused at start with the numbers. "auto": what the process holds when it opens plus
    # 80% of the memory available then (memory_budget.py). "off": no budget, the pool sized
    # by [pool] (budget_mb, slots, or half the memory left after the dense core). Unset:
    # "auto" where the pool lives in host memory (CPU, unified memory) and [pool] gives no
    # size; "off" with a [pool] size, on a discrete GPU, or distributed.
    budget_mb: Annotated[int, within(1, MIB_MAX)] | Literal["auto", "off"] | None = None
    # Model state (KV caches, DeltaNet state) within the budget: half for the sequences
    # decoding at once (it also caps a request's context), half for the prefix cache's
    # copies. 0 = an eighth of the budget.
    state_mb: Annotated[int, within(0, MIB_MAX)] = 0
    # MLX's temporaries above dense + pool + state (activations of a prefill slice: a
    # chunk's mixers and MoE halves run in slices that fit it; a decode graph) and its
    # buffer cache.
    temporaries_mb: Annotated[int, within(16, MIB_MAX)] = 150
    # Shrink the pool under memory pressure (Linux PSI, macOS pressure events) and grow it
    # back when the pressure is gone (pipeline/memory_pressure.py).
    adapt: bool = False
    # The token embedding (an untied one: a tied one is the lm_head): "file" reads the rows
    # a step needs from the container (273 MiB less resident at Qwen3.5's 248k vocabulary;
    # a lazy token is read back first), "resident" holds the table, "auto" is "file" on the
    # CPU backend and "resident" on a GPU (pipeline/models/file_embedding.py).
    embedding: Literal["auto", "resident", "file"] = "auto"


class ReaderConfig(_Section, frozen=True):
    # Expert reads in flight at once (disk threads). "auto": the smallest queue depth
    # that reaches the disk's bandwidth, measured at start (actors/queue_depth.py).
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=MAX_READERS)] | Literal["auto"] = "auto"
    # More disk threads that take demand reads only, so a read the compute waits for never
    # queues behind predictions in flight (none in the serial baseline; actors/reader.py).
    demand_lane: Annotated[int, within(0, 4)] = 1
    # No prediction starts while a demand read runs: reads in flight share the disk's
    # bandwidth, and the compute waits for the demand read only (with realistic routing a
    # demand read beside predictions took 2.3 ms, alone 1.0: H200, 2026-12-01).
    prefetch_yields: bool = True
    # The GIL's switch interval while reading (ms; 0 leaves Python's 5 ms): a disk thread
    # waits for the GIL between reads (actors/reader.py).
    switch_interval_ms: Annotated[float, msgspec.Meta(ge=0.0, le=5.0)] = 0.2
    # How reads reach the disk: "threads", one blocking read per disk thread; "uring", one
    # thread keeping them all in flight through an io_uring, one return into Python per
    # batch of reads that ended, not per read (actors/ring_reads.py; x86-64 Linux, threads
    # where the kernel refuses it).
    io: Literal["threads", "uring"] = "threads"
    # After a layer's reads are submitted, the event loop gives the GIL away at once
    # (`time.sleep(0)`) so the woken disk threads start sooner; it then waits to get it
    # back. Off: slower on the page cache in the engine (actors/reader.py, `hand_over`).
    gil_hand_over: bool = False
    # Per read, on EIO/short read, before the error propagates. The backoff doubles per
    # attempt and sleeps in the read's worker thread (which Ctrl-C cannot interrupt), so
    # both are bounded: at most 100 ms x (1 + 2 + 4 + 8 + 16) = 3.1 s per read, 1.6 s at once.
    retries: Annotated[int, within(0, 5)] = 2
    retry_backoff_ms: Annotated[float, within(0.0, 100.0)] = 10.0
    o_direct: bool = False  # bypass the page cache (Linux; falls back if unsupported)
    # Copy each blob into MLX memory in the reader's own thread rather than on the MLX
    # thread. "auto": on GPUs (where that copy is slower than the disk), if MLX allows it.
    stage_in_threads: Literal["auto", "on", "off"] = "auto"
    # How a blob reaches GPU memory: "direct", DMA from page-locked staging buffers into
    # the pool's rows (actors/cuda_direct.py; CUDA, where its probe passes); "load", MLX's
    # Load (a pageable copy) then an MLX scatter; "prefetch", managed memory moved in bulk
    # by the driver (actors/cuda_prefetch.py). "auto": direct where it can, else load.
    device_copy: Literal["auto", "direct", "load", "prefetch"] = "auto"
    # Install a read into its pool slot on a staging thread as it lands, when no queued
    # kernel can read that slot (layer-by-layer steps; actors/router.py): off the compute's
    # path and off the MLX thread. CPU pools and the direct path; elsewhere ignored.
    # "auto": on (pipeline/engine_parts.py says what was measured).
    land: Literal["auto", "on", "off"] = "auto"


class PrefetchConfig(_Section, frozen=True):
    strategy: str = "next-gate"
    depth: Annotated[int, within(1, 64)] = 1  # layers ahead, for "lookahead"
    max_per_layer: Annotated[int, within(1, 1 << 16)] | None = None  # cap on predicted experts per layer
    # Gate strategies: experts predicted beyond the top-k per layer, next in the gate's
    # ranking (more recall for more bytes; worth it where the disk idles).
    extra: Annotated[int, within(0, 64)] = 0
    # Gate strategies: a verify pass's predicted union (its positions' picks, ranked by how
    # many pick each) cut to its best N; "auto": 1.5 x the model's top-k; "off": whole. Its
    # wrong part is read on a disk a pass keeps busy (docs/speculative.md, session 40).
    pass_max_per_layer: Annotated[int, within(1, 1 << 16)] | Literal["auto", "off"] = "auto"
    combine: tuple[str, ...] = ()  # the strategies "combined" unions

    def __post_init__(self) -> None:
        one_of("strategy", self.strategy, PREFETCH_STRATEGIES)
        parts = tuple(s for s in PREFETCH_STRATEGIES if s not in ("none", "combined"))
        for s in self.combine:
            one_of("combine", s, parts)
        if self.strategy == "combined" and len(self.combine) < 2:
            raise ValueError('combine must list at least two strategies when strategy = "combined"')
        if self.strategy != "combined" and self.combine:
            raise ValueError(
                f'combine is only used with strategy = "combined", not {self.strategy!r}'
            )


class ComputeConfig(_Section, frozen=True):
    # Prompt tokens per prefill forward. 0 = follow the pool: the whole prompt (up to
    # prefill_max_tokens) in one layer-major pass when a layer's experts all fit in the
    # pool, so a prompt reads each expert it needs once; else as many tokens as the pool
    # can pin one layer's experts for (slots // top_k).
    prefill_chunk: Annotated[int, within(0, 1 << 16)] = 0
    prefill_max_tokens: Annotated[int, within(1, 1 << 16)] = 2048  # activation memory grows with the chunk
    # One host sync per decode token when the experts are expected to be resident:
    # "auto" (after a token that read nothing), "on" (always try first), "off".
    run_ahead: Literal["auto", "on", "off"] = "auto"
    # A decode token that reads experts queued whole, each MoE layer waiting on the GPU for
    # the host to answer with its slots (actors/device_wait.py): one host sync per token
    # instead of one per MoE layer. "auto": where its probe passes (MLX's CUDA backend with
    # direct installs) and the disk is fast (pipeline/engine_parts.py FAST_DISK_GB_S):
    # measured on the H200 (session 24, docs/results.md), 1.02-1.18x stepping on the page
    # cache, 0.88x on a 1.7 GB/s disk, where the reads, not the host, are what a layer
    # waits for. "emulate": the same protocol with the wait on the MLX thread (any backend;
    # no gain: for tests).
    device_wait: Literal["auto", "off", "emulate"] = "auto"
    # With every expert pooled, a lone sequence's decode queues a second step while the
    # host does the last token's bookkeeping (actors/decode.py): "auto" on GPUs (where the
    # host is what a token waits for; on MLX's CPU backend it competed with the compute:
    # 5 % slower on this project's 2-core VM), "on" on any backend, "off" never.
    decode_ahead: Literal["auto", "on", "off"] = "auto"
    overlap: bool = True  # false = the serial streamer baseline (no read/compute overlap)
    # Activation dtype. "auto": float32 on MLX's CPU backend (its bfloat16 kernels are ~10x
    # slower than float32 there), the model's own dtype on GPUs; "model": always the model's.
    dtype: Literal["auto", "model", "float32", "bfloat16", "float16"] = "auto"
    # Sequences decoded together in one batch (concurrent requests, n > 1, prompt lists);
    # more wait in the queue. 1 = one generation at a time.
    max_batch: Annotated[int, within(1, 256)] = 8
    # While others decode, a newcomer's prompt is prefilled this many tokens per compute
    # turn, one batch step between turns (neither starves the other).
    batch_prefill_chunk: Annotated[int, within(1, 1 << 16)] = 512
    # The batch's model state (KV caches grow with prompt + completion) is kept within
    # this many MiB: a request whose state would not fit waits. 0 = a quarter of the
    # memory left after the pool, as estimated when the engine opens.
    batch_memory_mb: Annotated[int, within(0, MIB_MAX)] = 0
    # Speculative decoding of a lone sequence (docs/speculative.md): "ngram" drafts from
    # the prompt and output so far, "mtp" from the checkpoint's MTP head, "auto" picks
    # the drafter and stops speculating where a verify pass costs more than it gives;
    # a request's `speculative` field overrides it. Output is the same either way.
    speculative: Literal["auto", "mtp", "ngram", "off"] = "off"
    draft_tokens: Annotated[int, within(1, 16)] = 3  # most drafts per verify pass
    # Attention keys and values held at 4 or 8 bits (0: the activations' dtype): a long
    # context's state in ~0.28x / ~0.53x the memory (pipeline/models/kv_quant.py; mlx-lm's
    # QuantizedKVCache: the logits are mlx-lm's with that cache, not the unquantized
    # model's; rows decoded together get the tokens each gets alone).
    kv_bits: Literal[0, 4, 8] = 0
    kv_group_size: Literal[32, 64, 128] = 64  # elements sharing a scale and a bias


class ChatMessage(_Section, frozen=True):
    role: Literal["system", "user", "assistant"]
    content: str


class RunConfig(_Section, frozen=True):
    # Each prompt is a plain string (completion) or a list of chat messages.
    prompts: Annotated[tuple[str | tuple[ChatMessage, ...], ...], msgspec.Meta(max_length=1024)] = ("Hello",)
    max_tokens: Annotated[int, within(1, TOKENS_MAX)] = 64
    stats: str | None = None  # JSON stats file
    trace: str | None = None  # event trace (timeline) file
    record_routing: str | None = None  # routing trace for `replay`


class ServerConfig(_Section, frozen=True):
    host: str = "127.0.0.1"
    # 0: any free port, the one bound said by the `server.listening` event (no window
    # between choosing a port and binding it for another process to take it in)
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    api_key: str | None = None  # when set, requests need `Authorization: Bearer <key>`
    max_queue: Annotated[int, within(1, 4096)] = 16  # requests waiting beyond this get 429
    max_body_bytes: Annotated[int, within(1, 1 << 30)] = 1 << 20
    context_limit: Annotated[int, within(1, TOKENS_MAX)] | None = None  # None = the model's max_position_embeddings
    aliases: tuple[str, ...] = ()  # more model names, listed by /v1/models
    strict_model: bool = False  # 404 for a request naming another model (else served anyway)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed (CORS); none by default
    # On SIGINT/SIGTERM, requests in flight get this long to finish before they are cut.
    shutdown_grace_s: Annotated[float, within(0.0, 3600.0)] = 5.0
    # Most tokens one request may generate; a request asking for more gets a 400 (as
    # OpenAI's API does), one asking for none gets this many at most. It bounds how long
    # one request can hold the engine while the others queue.
    max_tokens_limit: Annotated[int, within(1, TOKENS_MAX)] = 8192
    # With api_key set, /metrics needs the key too; true lets a scraper without it read them.
    metrics_without_key: bool = False
    # Seconds a chat template render (the container's code) or a tokenizing call may take;
    # past it the request gets a 400 and the render is stopped.
    prompt_budget_s: Annotated[float, within(0.0, 60.0, open_low=True)] = 10.0  # = offload.BUDGET_S
    # Prefix checkpoints (KV + DeltaNet state) also kept in this directory, reloaded after
    # a restart (pipeline/prefix_disk.py); unset = memory only. At most prefix_cache_disk_mb
    # there (least recently used go first); states under prefix_cache_min_tokens tokens
    # are cheaper to recompute than to write.
    prefix_cache_dir: str | None = None
    prefix_cache_disk_mb: Annotated[int, within(1, 1 << 22)] = 8192
    prefix_cache_min_tokens: Annotated[int, within(1, TOKENS_MAX)] = 256


class DistributedConfig(_Section, frozen=True):
    """Pipeline-parallel ranks over mlx.distributed (docs/distributed.md)."""

    # Set by `--distributed`: this process is one rank of an `mlx.launch` job.
    enabled: bool = False
    # mlx.distributed's backend: "ring" (TCP; also on CUDA hosts: NCCL has no send/recv),
    # "jaccl" (RDMA over Thunderbolt 5), "mpi", or "any" (MLX picks).
    backend: Literal["ring", "jaccl", "mpi", "any"] = "ring"
    # How layers are split: "layers" (equal counts), "weighted" (each rank's share follows
    # its measured free memory and disk read speed), or explicit first layers of ranks 1..
    split: Literal["layers", "weighted"] = "layers"
    boundaries: Annotated[tuple[Annotated[int, within(1, 1 << 16)], ...], msgspec.Meta(max_length=1024)] = ()
    # A reply from the next ranks that takes longer than this means they are lost: the
    # request fails (503) and every rank exits. Covers a cold prefill chunk on a slow disk.
    peer_timeout_s: Annotated[float, within(0.0, 86400.0, open_low=True)] = 300.0
    # Sequences on their own whose caches a later rank keeps, beyond the decode batch's
    # size (rank 0 sends no "sequence ended": the least recently used go).
    max_sequences: Annotated[int, within(1, 1024)] = 4
    # One host with several GPUs: rank r sees only GPU r (CUDA_VISIBLE_DEVICES=r).
    gpu_per_rank: bool = False


class LogConfig(_Section, frozen=True):
    level: str = "info"
    json: bool = False

    def __post_init__(self) -> None:
        one_of("level", self.level, LOG_LEVELS)


class PipelineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    model: ModelConfig
    pool: PoolConfig = PoolConfig()
    memory: MemoryConfig = MemoryConfig()
    reader: ReaderConfig = ReaderConfig()
    prefetch: PrefetchConfig = PrefetchConfig()
    compute: ComputeConfig = ComputeConfig()
    sampling: SamplingConfig = SamplingConfig()  # unset keys: the model's, then the API's
    chat: ChatConfig = ChatConfig()
    run: RunConfig = RunConfig()
    server: ServerConfig = ServerConfig()
    distributed: DistributedConfig = DistributedConfig()
    log: LogConfig = LogConfig()

    def to_toml_dict(self) -> dict[str, Any]:
        """Plain dicts/lists for printing; unset (None) keys are left out, as TOML has no null."""
        return drop_none(msgspec.to_builtins(self))

    def to_toml(self) -> str:
        """The effective config as TOML text (loads back to an equal config)."""
        return dumps_toml(self.to_toml_dict())
