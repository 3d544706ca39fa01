"""The engine: opens a container, wires the actors, and serves generations in order.

    async with open_engine(config) as engine:
        async for event in engine.generate("Hello", SamplingParams(max_tokens=16)):
            ...

`Engine` is the face every caller uses (the library, the CLI, the server, the
benchmarks); its actors live in an `EngineCore` (pipeline/engine_core.py), wired by
`open_core` (pipeline/engine_open.py). Generations queue in FIFO order and decode
together in one batch, up to `compute.max_batch` (they share the pool, whose slots are
the scarce resource); cancelling a caller stops its generation at the next step.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing, asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from actors.sampling_params import SamplingParams
from pipeline.chat_template import template_kwargs
from pipeline.config.schema import PipelineConfig
from pipeline.counters import Counters
from pipeline.engine_core import EngineCore, ModelFacts
from pipeline.engine_open import open_core
from pipeline.engine_sizing import PoolTooSmall
from pipeline.events import Event
from pipeline.generation import Generation
from pipeline.generation_config import default_params
from pipeline.memory_breakdown import MemoryBreakdown, breakdown
from pipeline.memory_facts import MemoryPlan
from pipeline.prefix_cache import PrefixCache
from pipeline.speculation import mtp_snapshot, speculation_snapshot
from qpack.reader import Container, ExpertIO

if TYPE_CHECKING:
    from pipeline.distributed.stage import Stage

class Engine:
    """An open engine: generations in, text and stats out.

    What a face may use: `facts` (the model's shape and the engine's sizes), `config`,
    `container` (the open `qpack.Container`), `tokenizer`, `prefix_cache`; `encode`,
    `chat_tokens`, `generate`, `chat`, `start`, `warm`; `counters()` (subtract two for
    what happened between), `pool_snapshot()`, `default_params()`, `watch_tokens()`; the
    queue's state (`busy`, `waiting`, `running`, `generations`). The actors stay inside
    (`EngineCore`, pipeline/engine_core.py); what only a benchmark does to an engine
    (routing by a routing model, emulated drafts) is in pipeline/engine_hooks.py.
    """

    def __init__(self, core: EngineCore) -> None:
        self._core = core

    @property
    def facts(self) -> ModelFacts:
        return self._core.facts

    @property
    def config(self) -> PipelineConfig:
        return self._core.config

    @property
    def container(self) -> Container:
        return self._core.container

    @property
    def tokenizer(self) -> Any:
        """mlx-lm's tokenizer (None on a later pipeline rank, which never sees text)."""
        return self._core.tokenizer

    @property
    def prefix_cache(self) -> PrefixCache:
        return self._core.prefix_cache

    @property
    def name(self) -> str:
        return self._core.facts.name

    @property
    def pool_bytes(self) -> int:
        return self._core.facts.pool_bytes

    @property
    def context_limit(self) -> int:
        return self._core.facts.context_limit

    @property
    def max_batch(self) -> int:
        """Sequences decoded together at most (a distributed job's smallest rank's)."""
        return self._core.max_batch

    @property
    def largest_batch(self) -> int:
        """The most sequences one decode step has carried so far."""
        return self._core.batch.stats.largest

    @property
    def busy(self) -> bool:
        """A generation is running (prefilling or decoding)."""
        return self._core.compute_task.busy

    @property
    def waiting(self) -> int:
        """Generations submitted and not yet started."""
        return self._core.waiting

    @property
    def running(self) -> int:
        """Generations admitted and not yet ended (prefilling or in the decode batch)."""
        return len(self._core.compute_task.running)

    @property
    def generations(self) -> int:
        """Generations ended (finished, failed or cancelled)."""
        return self._core.generations

    @property
    def trimmed_mb(self) -> float:
        """Memory handed back to the system between generations (`heap_trim`)."""
        return self._core.heap_trimmer.trimmed_mb

    def counters(self) -> Counters:
        return self._core.counters()

    @property
    def memory_plan(self) -> MemoryPlan | None:
        """Where memory.budget_mb went (None without a budget): docs/memory.md."""
        return self._core.memory_plan

    def memory_breakdown(self, peak_rss_mb: float, mlx_peak_mb: float, tokens: int) -> MemoryBreakdown:
        """This process's peak, split into its parts (pipeline/memory_breakdown.py)."""
        return breakdown(self._core, peak_rss_mb, mlx_peak_mb, tokens)

    def default_params(self, **overrides: Any) -> SamplingParams:
        """The config's `[sampling]` over the model's generation_config.json, `overrides`
        on top: what a generation uses when its caller says nothing more."""
        return default_params(self._core.facts.root, self._core.config.sampling, **overrides)

    @contextmanager
    def watch_tokens(self, hook: Callable[[str], None]) -> Iterator[None]:
        """Call `hook(phase)` ("prefill" / "decode") as each forward starts, while inside
        (benchmarks split prefill from decode there: `counters()` at the first decode)."""
        hooks = self._core.compute.token_hooks
        hooks.append(hook)
        try:
            yield
        finally:
            hooks.remove(hook)

    def save_routing(self, path: str | Path) -> bool:
        """Write the recorded routing trace (`open_engine(record_routing=True)`); False
        when none was recorded."""
        recorder = self._core.compute.recorder
        if recorder is None:
            return False
        recorder.save(path)
        return True

    def routing_trace(self) -> Any:
        """The recorded routing trace so far (None unless `record_routing`)."""
        recorder = self._core.compute.recorder
        return None if recorder is None else recorder.trace

    def encode(self, text: str) -> list[int]:
        return list(self._core.tokenizer.encode(text, add_special_tokens=False))

    def chat_tokens(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        kwargs: dict[str, Any] = {"add_generation_prompt": True,
                                  **template_kwargs(self.config.chat, enable_thinking)}
        if tools:
            kwargs["tools"] = list(tools)
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, **kwargs)
        return self.encode(text)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
        admitted: trio.Event | None = None,
    ) -> AsyncGenerator[Event, None]:
        """Text deltas as they are decoded, then `Done` with stats.

        `on_prefill(done, total)` is called after each prefill chunk (progress bars);
        `admitted` is set when the generation leaves the queue and starts. Wrap in
        `contextlib.aclosing` when you may stop early, so the pool is handed back at once
        rather than when the generator is collected.
        """
        generation = self.start(prompt, params, on_prefill, admitted)
        async with aclosing(generation.run()) as events:
            async for event in events:
                yield event

    def check(self, tokens: Sequence[int], params: SamplingParams | None = None) -> None:
        """Refuse what `start` would: an empty prompt, one at the context limit
        (`PromptTooLong`), a token id or a `logit_bias` id outside the vocabulary
        (ValueError, one line naming it)."""
        Generation(self._core, list(tokens), params or self.default_params()).check()

    def start(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
        admitted: trio.Event | None = None,
    ) -> Generation:
        """Submit a generation now, to run concurrently with others (one decode batch);
        read it with `generation.run()`, or `await generation.close()` if you never do."""
        tokens = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        generation = Generation(self._core, tokens, params or self.default_params(), on_prefill)
        generation.admitted = admitted
        generation.check()
        generation.submit()
        return generation

    async def chat(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
        enable_thinking: bool | None = None,
    ) -> AsyncGenerator[Event, None]:
        # Close the inner generator here, in this task: it holds the engine's lock.
        tokens = self.chat_tokens(messages, tools, enable_thinking)
        async with aclosing(self.generate(tokens, params, on_prefill)) as events:
            async for event in events:
                yield event

    async def warm(self) -> int:
        """Read every expert into the pool (it must hold them all); returns how many were read.

        For users with memory to spare (and the `warm-all` benchmark): decode then never
        waits for the disk and runs ahead, one host sync per token.
        """
        core = self._core
        router, compute = core.router, core.compute
        num_experts = core.facts.num_experts
        total = num_experts * len(core.facts.moe_layers)
        if router.table.num_slots < total:
            raise PoolTooSmall(
                f"warming needs a slot for every expert ({total}); the pool has "
                f"{router.table.num_slots}"
            )
        misses = router.table.misses
        async with core.batch.exclusive():
            try:
                for layer in core.facts.moe_layers:
                    compute.tick += 1
                    await router.demand(layer, range(num_experts), compute.tick)
            finally:
                with trio.CancelScope(shield=True):
                    await router.drain()
        return router.table.misses - misses

    def pool_snapshot(self) -> dict[str, Any]:
        core = self._core
        table = core.router.table.snapshot()
        counters = core.counters()
        return {
            "slots": table.num_slots,
            # Slot ranges the pool is cut into (actors/pool/banks.py); 1: one array each.
            "pool_banks": len(core.router.table.banks or [range(table.num_slots)]),
            "resident": table.resident,
            "pinned": table.pinned,
            "hit_rate": table.hit_rate,
            "pool_bytes": self.pool_bytes,
            "loads_in_flight": len(core.router.loads),
            "generations": core.generations,
            "batch_size": core.batch.size,
            "batch_steps": counters.batch_steps,
            "batch_rows_stepped": counters.batch_rows_stepped,
            "expert_reads": counters.reads,
            "expert_read_bytes": counters.bytes_read,
            "stall_seconds": counters.stall_seconds,
            "prefetch_hits_waited": counters.prefetch_hits_waited,
            "prefetch_shelved": counters.shelved,
            "mlx_seconds": counters.mlx_seconds,
            "run_ahead_tokens": counters.run_ahead_tokens,
            "run_ahead_misses": counters.run_ahead_misses,
            "ahead_steps": counters.ahead_steps,
            "awaited_tokens": counters.awaited_tokens,
            **speculation_snapshot(core.batch.speculation.stats),
            **mtp_snapshot(core.mtp),
        }


@asynccontextmanager
async def open_engine(
    config: PipelineConfig, *, stage: Stage | None = None, record_routing: bool = False,
    io: ExpertIO | None = None,
) -> AsyncIterator[Engine]:
    """Open the container in `config.model.path` and start the actors.

    `stage`: this process's part of a distributed job (`Stage.join`); the engine then
    holds that rank's layers only. `io` replaces the container's positional-read layer
    (fault injection in tests). `record_routing` keeps a routing trace (`save_routing`).
    """
    async with open_core(config, stage=stage, record_routing=record_routing, io=io) as core:
        yield Engine(core)
