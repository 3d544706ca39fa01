"""This process's part of a pipeline-parallel job: its rank, its layers, its link.

Made once per model (`Stage.join`): the ranks shake hands (same container? each rank's
free memory and disk speed for a weighted split), every rank computes the same plan, and
`open_engine` then loads only this rank's dense weights and sizes the pool for its
layers. After the actors start (`attach`) the ranks agree on the decode batch's size:
the smallest any rank's pool can pin (each rank sized its pool on its own). The last
rank tells rank 0 the dtype its logits come in with its first logits.

Rank 0 crosses the boundary inside a forward, on the MLX thread (`exchange`); the later
ranks in their stage loop (`pipeline/distributed/worker.py`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import structlog

from actors.run_ahead import RunAheadPolicy
from pipeline.config.schema import DistributedConfig
from pipeline.distributed import wire
from pipeline.distributed.errors import DistributedSetupError
from pipeline.distributed.link import Link
from pipeline.distributed.model import StageModel
from pipeline.distributed.plan import (
    StagePlan,
    check_boundaries,
    equal_boundaries,
    plan_for,
    share_weights,
    weighted_boundaries,
    with_moe_layers,
)
from pipeline.distributed.prefixes import StagePrefixCache
from pipeline.distributed.probe import (
    fingerprint,
    free_memory_mb,
    host_id,
    kept_bytes,
    read_speed_mb_s,
)
from pipeline.models.dense import load_dense
from pipeline.prefix_cache import PrefixCache
from qpack.reader import Container

if TYPE_CHECKING:
    from pipeline.engine_core import EngineCore

log = structlog.get_logger("moestream.distributed")


@dataclass
class BoundaryStats:
    forwards: int = 0  # forwards that crossed (prefill chunks and decode tokens)
    tokens: int = 0
    seconds: float = 0.0  # rank 0: send until logits back (the later ranks' work included)
    busy_seconds: float = 0.0  # a later rank: hidden state in until its output sent
    bytes_sent: int = 0
    # The same for decode forwards (one token each) alone: the boundary's cost per token.
    decode_forwards: int = 0
    decode_seconds: float = 0.0
    decode_busy_seconds: float = 0.0


class NoPrefixCache(PrefixCache):
    """A later rank's own prefix cache stays off: it never generates (rank 0's decides)."""

    def take(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        return None, 0

    def put(self, tokens: Sequence[int], cache: list[Any]) -> None:
        return None

    def wants(self, before: int, after: int, end: int) -> bool:
        return False


class Stage:
    def __init__(self, link: Link, plan: StagePlan, settings: DistributedConfig,
                 hidden_size: int, vocab_size: int, tied: bool) -> None:
        self.link = link
        self.tied = tied  # the head is the embedding (the last rank then loads it)
        self.plan = plan
        self.settings = settings
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.logits_dtype: mx.Dtype | None = None  # rank 0: learnt from the last rank
        self.dtype_sent = False  # the last rank: rank 0 knows its logits' dtype
        self.stats = BoundaryStats()
        self.dense_bytes = 0  # this rank's share of dense.safetensors
        self.ranks_on_host = 1  # ranks of the job on this machine (this one included)
        self.core: EngineCore | None = None  # this rank's engine, once its actors run

    # -- setting up ----------------------------------------------------------------------

    @classmethod
    def join(cls, link: Link, container: Container, settings: DistributedConfig) -> Stage:
        """Handshake and plan, for the model in `container` (blocking; before the engine)."""
        m = container.manifest
        weighted = settings.split == "weighted" and not settings.boundaries
        row = np.array([fingerprint(container), m.num_layers, free_memory_mb(),
                        read_speed_mb_s(container) if weighted else 0.0, host_id()])
        table = link.call(lambda: wire.all_rows(row, link.rank, link.size),
                          timeout=settings.peer_timeout_s, what="handshake")
        odd = [r for r in range(link.size) if table[r, 0] != table[0, 0]]
        if odd:
            raise DistributedSetupError(
                f"ranks {odd} opened another container than rank 0 ({container.root} here): "
                "every rank needs the same .qpack (a copy, or a shared filesystem)")
        # Ranks on one host share its memory: each counts its part of what is free there
        # (free_memory_mb is a GPU's on CUDA: not shared when each rank has a GPU of its own).
        on_host = np.array([np.sum(table[:, 4] == table[r, 4]) for r in range(link.size)])
        own_gpu = settings.gpu_per_rank and mx.cuda.is_available()
        free_mb = table[:, 2] if own_gpu else table[:, 2] / on_host
        if settings.boundaries:
            bounds = check_boundaries(m.num_layers, link.size, settings.boundaries)
        elif weighted:
            bounds = weighted_boundaries(m.num_layers, share_weights(free_mb.tolist(), table[:, 3].tolist()))
        else:
            bounds = equal_boundaries(m.num_layers, link.size)
        bounds = with_moe_layers(bounds, m.num_layers, [e.index for e in m.layers],
                                 given=bool(settings.boundaries))
        plan = plan_for(link.rank, link.size, m.num_layers, bounds)
        text = container.config.get("text_config", container.config)
        log.info("distributed.plan", rank=plan.rank, size=plan.size, layers=f"{plan.start}-{plan.stop - 1}",
                 boundaries=bounds, free_mb=[round(v) for v in free_mb],
                 ranks_on_host=int(on_host[link.rank]),
                 read_mb_s=[round(v) for v in table[:, 3]] if weighted else None)
        stage = cls(link, plan, settings, int(text["hidden_size"]), int(text["vocab_size"]),
                    bool(text.get("tie_word_embeddings", container.config.get("tie_word_embeddings"))))
        stage.dense_bytes = kept_bytes(container.dense_path, stage.keep)
        stage.ranks_on_host = int(on_host[link.rank])
        return stage

    def keep(self, name: str) -> bool:
        """Which dense tensors this rank loads: its layers', rank 0 the embedding, the last
        rank the final norm and head (the embedding too when the head is tied to it)."""
        parts = name.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            if i + 1 < len(parts) and parts[i + 1].isdigit():
                return int(parts[i + 1]) in self.plan.layers
        if "embed_tokens" in parts:
            return self.plan.first or (self.plan.last and self.tied)
        if parts[-2:-1] == ["norm"] or "lm_head" in parts:
            return self.plan.last
        return True

    def load_dense(self, config: dict[str, Any], path: Path, head_dtype: Any = None) -> Any:
        """This rank's dense tensors; the last rank's untied head widened as one process's
        is (`widen_head`: no cast of its scales per step)."""
        return load_dense(config, path, keep=self.keep, head_dtype=head_dtype)

    def model(self, *args: Any, **kwargs: Any) -> StageModel:
        return StageModel(self, *args, **kwargs)

    def expert_layers(self, container: Container) -> int:
        """MoE layers this rank streams (the pool's upper bound)."""
        return sum(1 for e in container.manifest.layers if e.index in self.plan.layers)

    async def attach(self, core: EngineCore) -> None:
        """After the actors start: the settings a rank needs, and the batch size every
        rank's pool can pin (a step's rows reach every rank: the smallest pool sets it)."""
        self.core = core
        row = np.array([core.max_batch])
        table = await self.link.run(lambda: wire.all_rows(row, self.link.rank, self.link.size),
                                    self.settings.peer_timeout_s, "batch size")
        core.max_batch = core.compute_task.capacity = int(table[:, 0].min())
        log.info("distributed.batch", rank=self.plan.rank, max_batch=core.max_batch,
                 per_rank=[int(v) for v in table[:, 0]])
        # One sync per layer: a run-ahead token is rolled back at times, which the later
        # ranks would have to mirror; the boundary is crossed once per forward either way.
        core.compute.run_ahead = RunAheadPolicy("off")
        own = core.prefix_cache
        core.prefix_cache = (StagePrefixCache(own.max_bytes, own.max_entries, own.interval)
                               if self.plan.first else NoPrefixCache())

    def pool_counters(self) -> list[float]:
        """hits, misses, reads, bytes read of this rank's pool (zeros before an engine)."""
        if self.core is None:
            return [0.0] * 4
        c = self.core.counters()
        return [c.hits, c.misses, c.reads, c.bytes_read]

    # -- rank 0, on the MLX thread -------------------------------------------------------

    def exchange(self, h: mx.array, seqs: list[int], all_positions: bool,
                 decode: bool) -> mx.array:
        """Send the residual stream [rows, tokens, H] on; the last rank's logits ([vocab],
        [rows, vocab] for a batch of rows, or [tokens, vocab] for every position)."""
        rows, tokens = h.shape[0], h.shape[1]
        header = wire.Header(wire.Command.FORWARD, seqs[0], tokens, all_positions, decode,
                             wire.dtype_code(h.dtype), h.shape[2], rows)
        bits = wire.to_bits(h)
        shape = (tokens if all_positions else rows, self.vocab_size)
        last = self.plan.size - 1
        prefixes = self.core.prefix_cache if self.core is not None else None
        commands = prefixes.take_pending() if isinstance(prefixes, StagePrefixCache) else []

        def cross() -> np.ndarray:
            for command in commands:  # the prefix cache's, before the forward needing them
                wire.send(command, 1)
            wire.send_forward(header, seqs, bits, 1)
            self.link.doorbell.wait()
            if self.logits_dtype is None:  # the first logits come after their dtype's code
                code = wire.recv((1,), np.int32, last)
                self.logits_dtype = wire.DTYPES[int(code[0])]
                self.link.doorbell.wait()
            return wire.recv(shape, wire.bits_dtype(self.logits_dtype), last)

        start = time.perf_counter()
        out = self.link.call(cross, timeout=self.settings.peer_timeout_s, what="forward")
        took = time.perf_counter() - start
        self.stats.seconds += took
        self.stats.forwards += 1
        if decode:
            self.stats.decode_forwards += 1
            self.stats.decode_seconds += took
        self.stats.tokens += rows * tokens
        self.stats.bytes_sent += bits.nbytes
        assert self.logits_dtype is not None
        logits = wire.from_bits(out, self.logits_dtype)
        return logits if all_positions or rows > 1 else logits[0]

    def shutdown(self, timeout: float = 10.0) -> None:
        """Rank 0, when done: tell the later ranks to finish (they exit their loop)."""
        if self.plan.size == 1 or self.link.broken is not None:
            return
        header = wire.Header(wire.Command.SHUTDOWN).encode()
        self.link.call(lambda: wire.send(header, 1), timeout=timeout, what="shutdown")

