"""A later rank's loop: receive a residual stream, run this rank's layers, send on.

Rank r > 0 waits (on its link thread, so its MLX thread stays free) for rank r-1's
header. `FORWARD`: it takes the residual stream, runs its layers through its own compute
actor (its own pool, router, readers and prefetcher, exactly as one process steps its
layers), and sends the result on: the residual stream to rank r+1, or from the last rank
the logits to rank 0. The prefix cache's commands (`KEEP`, `SNAPSHOT`, `RESTORE`,
`DROP`: pipeline/distributed/prefixes.py): applied to this rank's caches and passed on.
`SHUTDOWN`: passed on, and the loop ends.

Caches are kept per sequence id: a new id is a new sequence (rank 0 made a new cache: a
new request, or one after a cancel). Rank 0 sends no "sequence ended", so the plain
caches of the `max_sequences` (plus the decode batch's size) most recently used stay.
A decode step of a batch carries its rows' ids; when they differ from the last step's,
rank 0 regrouped between the two steps (`actors/decode_batch.py`: leavers cut out, a row
left alone taken back to its own caches, newcomers appended), and this rank does the same
cache operations in the same order (`_regroup`), so its batch stays row for row rank 0's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import msgspec
import numpy as np
import structlog

from actors.batch_regroup import regroup_caches
from actors.compute import Phase
from pipeline.distributed import wire
from pipeline.distributed.errors import DistributedSetupError
from pipeline.distributed.model import seqs_of, with_seqs
from pipeline.distributed.prefixes import PrefixMirror
from pipeline.distributed.stage import Stage
from pipeline.engine_core import EngineCore

log = structlog.get_logger("moestream.distributed")


class StageLoop:
    def __init__(self, core: EngineCore, stage: Stage) -> None:
        self.core = core
        self.stage = stage
        self.caches: OrderedDict[int, list[Any]] = OrderedDict()  # sequences on their own
        self.batch: list[Any] | None = None  # the decode batch's merged caches (ids: seqs_of)
        self.kept = stage.settings.max_sequences + core.max_batch
        self.prefixes = PrefixMirror()  # rank 0's prefix cache entries, this rank's layers

    def _cache(self, seq: int) -> list[Any]:
        cache = self.caches.pop(seq, None)
        if cache is None:  # tagged with rank 0's id (the batch operations carry it)
            cache = with_seqs(self.core.model.make_cache(), [seq])
        self.caches[seq] = cache
        while len(self.caches) > self.kept:
            self.caches.popitem(last=False)
        return cache

    def _caches_for(self, seqs: list[int]) -> list[Any]:
        old = seqs_of(self.batch) if self.batch is not None else []
        if seqs == old and self.batch is not None:
            return self.batch
        if len(seqs) == 1 and seqs[0] not in old:
            # A sequence on its own: a newcomer's prefill (the batch decodes on), or a lone
            # decode (an ended batch's caches go at the next regroup).
            return self._cache(seqs[0])
        return self._regroup(old, seqs)

    def _regroup(self, old: list[int], seqs: list[int]) -> list[Any]:
        """Rank 0's regroup (`DecodeBatch._regroup_mlx`), from the ids before and after: the
        same `regroup_caches` (leaving rows' copies are the prefix cache's `KEEP`)."""
        keep = [i for i, s in enumerate(old) if s in seqs]
        kept = [old[i] for i in keep]
        joining = seqs[len(kept):]
        if seqs[:len(kept)] != kept or any(s in old or s not in self.caches for s in joining):
            raise DistributedSetupError(
                f"rank {self.stage.plan.rank}: a batch of sequences {seqs} after {old}: "
                "not a regroup of the last (or a sequence's caches are gone)")
        newcomers = [self.caches.pop(s) for s in joining]
        cache, _ = regroup_caches(self.core.model.batch_caches(), self.batch, len(old), keep,
                                  newcomers)
        assert cache is not None
        if len(seqs) == 1:  # the one row left goes back to its own caches
            self.batch = None
            self.caches[seqs[0]] = cache
            return self._cache(seqs[0])
        self.batch = cache
        return cache

    async def run(self) -> None:
        """Serve forwards until rank 0 says `SHUTDOWN` (RankLost if a neighbour goes)."""
        stage, link, plan = self.stage, self.stage.link, self.stage.plan
        src = plan.rank - 1
        while True:
            header, seqs, bits = await link.run(partial(_receive, src, link.doorbell.wait),
                                                None, "waiting for work")
            if header.command in PREFIX_COMMANDS:
                await self.core.worker.run(self._prefix_command, header)
                if not plan.last:
                    await link.run(partial(wire.send, header.encode(), plan.rank + 1),
                                   stage.settings.peer_timeout_s, "prefix cache")
                continue
            if header.command == wire.Command.SHUTDOWN:
                if not plan.last:
                    await link.run(partial(wire.send, header.encode(), plan.rank + 1),
                                   stage.settings.peer_timeout_s, "shutdown")
                log.info("distributed.stage_done", rank=plan.rank, forwards=stage.stats.forwards)
                return
            start = time.perf_counter()
            out, dtype = await self._forward(header, seqs, bits)
            code = None if stage.dtype_sent or not plan.last else wire.dtype_code(dtype)
            stage.dtype_sent = True
            # What this rank sends on is in its own output's dtype.
            header = msgspec.structs.replace(header, dtype=wire.dtype_code(dtype))
            await link.run(partial(_send_on, plan.last, plan.rank, header, seqs, out, code),
                           stage.settings.peer_timeout_s, "forward")
            took = time.perf_counter() - start
            stage.stats.busy_seconds += took
            if header.decode:
                stage.stats.decode_forwards += 1
                stage.stats.decode_busy_seconds += took
            stage.stats.forwards += 1
            stage.stats.tokens += header.rows * header.tokens
            stage.stats.bytes_sent += out.nbytes

    def _prefix_command(self, header: wire.Header) -> None:
        self.prefixes.apply(header, self.caches, self.batch, self.core.model.batch_caches())

    async def _forward(self, header: wire.Header, seqs: list[int],
                       bits: np.ndarray) -> tuple[np.ndarray, mx.Dtype]:
        core = self.core
        cache = await core.worker.run(self._caches_for, seqs)
        dtype = wire.DTYPES[header.dtype]

        first = core.model.moe_layers[0]
        predict = core.compute.strategy.name != "none"

        def inbox() -> list[int]:
            h = wire.from_bits(bits, dtype)
            core.model.inbox = h  # type: ignore[attr-defined]  # a rank's model is a StageModel
            return _first_layer_guess(core, first, h) if predict else []

        guess = await core.worker.run(inbox)
        if guess:
            # One process would have predicted this layer from the layer before it (on
            # the rank before): predict it from what arrived, ahead of its attention.
            await core.router.prefetch([(first, guess)], core.compute.tick)
        phase: Phase = "decode" if header.decode else "prefill"
        placeholders = [0] * header.tokens  # the count only: the stream is in the inbox
        async with core.lock:
            out = await core.compute.forward(placeholders, cache, phase, header.all_positions)
        return await core.worker.run(_rows, out)


PREFIX_COMMANDS = (wire.Command.KEEP, wire.Command.SNAPSHOT, wire.Command.RESTORE,
                   wire.Command.DROP)


def _first_layer_guess(core: EngineCore, layer: int, h: mx.array) -> list[int]:
    """On the MLX thread: layer `layer`'s router applied to the residual stream entering
    it (next-gate prefetch, from one step closer than one process can); in prefill (and
    for a batch) the union over the tokens (rows), as the gate strategies predict there."""
    logits = core.model.router_logits(layer, h.reshape(-1, h.shape[-1]))
    k = core.model.top_k
    top = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
    ids = list(dict.fromkeys(int(e) for e in np.array(top).reshape(-1)))
    cap = core.config.prefetch.max_per_layer
    return ids[:cap] if cap else ids


def _rows(out: mx.array) -> tuple[np.ndarray, mx.Dtype]:
    """On the MLX thread: what to send, as bits ([vocab] logits as one row), and the dtype
    they are the bits of (rank 0 learns the logits' from the first: whatever the head gives)."""
    return wire.to_bits(out.reshape(1, -1) if out.ndim == 1 else out), out.dtype


def _send_on(last: bool, rank: int, header: wire.Header, seqs: list[int], out: np.ndarray,
             code: int | None) -> None:
    """The logits to rank 0 (from the last rank, the first time after their dtype's code),
    else the residual stream to rank+1."""
    if last:
        if code is not None:
            wire.send(np.array([code], np.int32), 0)
        wire.send(out, 0)
    else:
        wire.send_forward(header, seqs, out, rank + 1)


def _receive(src: int, ready: Callable[[], object]) -> tuple[wire.Header, list[int], np.ndarray]:
    ready()  # sleeps until rank src writes (MLX's own receive would spin meanwhile)
    header = wire.recv_header(src)
    if header.command != wire.Command.FORWARD:
        return header, [], np.zeros(0, np.uint32)
    seqs, bits = wire.recv_forward(header, src)
    return header, seqs, bits
