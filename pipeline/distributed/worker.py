"""A later rank's loop: receive a residual stream, run this rank's layers, send on.

Rank r > 0 waits (on its link thread, so its MLX thread stays free) for rank r-1's
header. `FORWARD`: it takes the residual stream, runs its layers through its own compute
actor (its own pool, router, readers and prefetcher, exactly as one process steps its
layers), and sends the result on: the residual stream to rank r+1, or from the last rank
the logits to rank 0. `SHUTDOWN`: passed on, and the loop ends.

Caches are kept per sequence id, the `max_sequences` most recent: a new id is a new
sequence (rank 0 made a new cache: a new request, or one after a cancel).
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

from pipeline.distributed import wire
from pipeline.distributed.stage import Stage
from pipeline.engine import Engine

log = structlog.get_logger("moestream.distributed")


class StageLoop:
    def __init__(self, engine: Engine, stage: Stage) -> None:
        self.engine = engine
        self.stage = stage
        self.caches: OrderedDict[int, list[Any]] = OrderedDict()

    def _cache(self, seq: int) -> list[Any]:
        cache = self.caches.pop(seq, None)
        if cache is None:
            cache = self.engine.model.make_cache()
        self.caches[seq] = cache
        while len(self.caches) > self.stage.settings.max_sequences:
            self.caches.popitem(last=False)
        return cache

    async def run(self) -> None:
        """Serve forwards until rank 0 says `SHUTDOWN` (RankLost if a neighbour goes)."""
        stage, link, plan = self.stage, self.stage.link, self.stage.plan
        src = plan.rank - 1
        while True:
            header, bits = await link.run(partial(_receive, src, link.doorbell.wait), None,
                                          "waiting for work")
            if header.command == wire.Command.SHUTDOWN:
                if not plan.last:
                    await link.run(partial(wire.send, header.encode(), plan.rank + 1),
                                   stage.settings.peer_timeout_s, "shutdown")
                log.info("distributed.stage_done", rank=plan.rank, forwards=stage.stats.forwards)
                return
            start = time.perf_counter()
            out, dtype = await self._forward(header, bits)
            code = None if stage.dtype_sent or not plan.last else wire.dtype_code(dtype)
            stage.dtype_sent = True
            # What this rank sends on is in its own output's dtype.
            header = msgspec.structs.replace(header, dtype=wire.dtype_code(dtype))
            await link.run(partial(_send_on, plan.last, plan.rank, header, out, code),
                           stage.settings.peer_timeout_s, "forward")
            took = time.perf_counter() - start
            stage.stats.busy_seconds += took
            if header.decode:
                stage.stats.decode_forwards += 1
                stage.stats.decode_busy_seconds += took
            stage.stats.forwards += 1
            stage.stats.tokens += header.tokens
            stage.stats.bytes_sent += out.nbytes

    async def _forward(self, header: wire.Header, bits: np.ndarray) -> tuple[np.ndarray, mx.Dtype]:
        engine = self.engine
        cache = self._cache(header.seq)
        dtype = wire.DTYPES[header.dtype]

        first = engine.model.moe_layers[0]
        predict = engine.compute.strategy.name != "none"

        def inbox() -> list[int]:
            h = wire.from_bits(bits, dtype)
            engine.model.inbox = h  # type: ignore[attr-defined]
            return _first_layer_guess(engine, first, h) if predict else []

        guess = await engine.worker.run(inbox)
        if guess:
            # One process would have predicted this layer from the layer before it (on
            # the rank before): predict it from what arrived, ahead of its attention.
            await engine.router.prefetch([(first, guess)], engine.compute.tick)
        phase = "decode" if header.decode else "prefill"
        placeholders = [0] * header.tokens  # the count only: the stream is in the inbox
        async with engine.lock:
            out = await engine.compute.forward(placeholders, cache, phase, header.all_positions)
        return await engine.worker.run(_rows, out)


def _first_layer_guess(engine: Engine, layer: int, h: mx.array) -> list[int]:
    """On the MLX thread: layer `layer`'s router applied to the residual stream entering
    it (next-gate prefetch, from one step closer than one process can); in prefill the
    union over the chunk's tokens, as the gate strategies predict there."""
    logits = engine.model.router_logits(layer, h[0])
    k = engine.model.top_k
    top = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
    ids = list(dict.fromkeys(int(e) for e in np.array(top).reshape(-1)))
    cap = engine.config.prefetch.max_per_layer
    return ids[:cap] if cap else ids


def _rows(out: mx.array) -> tuple[np.ndarray, mx.Dtype]:
    """On the MLX thread: what to send, as bits ([vocab] logits as one row), and the dtype
    they are the bits of (rank 0 learns the logits' from the first: whatever the head gives)."""
    return wire.to_bits(out.reshape(1, -1) if out.ndim == 1 else out), out.dtype


def _send_on(last: bool, rank: int, header: wire.Header, out: np.ndarray,
             code: int | None) -> None:
    """The logits to rank 0 (from the last rank, the first time after their dtype's code),
    else the residual stream to rank+1."""
    if last:
        if code is not None:
            wire.send(np.array([code], np.int32), 0)
        wire.send(out, 0)
    else:
        wire.send_forward(header, out, rank + 1)


def _receive(src: int, ready: Callable[[], object]) -> tuple[wire.Header, np.ndarray]:
    ready()  # sleeps until rank src writes (MLX's own receive would spin meanwhile)
    header = wire.recv_header(src)
    if header.command != wire.Command.FORWARD:
        return header, np.zeros(0, np.uint32)
    kind = wire.bits_dtype(wire.DTYPES[header.dtype])
    return header, wire.recv((1, header.tokens, header.hidden), kind, src)
