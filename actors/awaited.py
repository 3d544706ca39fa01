"""A decode token queued whole, its MoE layers waiting on the GPU for the host's answers.

The host side of `actors/device_wait.py`. The MLX thread builds and evaluates the token
(`launch`: `ForwardStep.launch_with`, each layer's slots from a wait) while the compute
task (`queued_whole`) serves the layers as they are published: for each MoE layer
in order it reads the chosen ids and a gate strategy's ranking of the next layers
(`routed`), makes the demand the per-layer path makes (the pool, the prefetch orders and
`replay` see the same requests in the same order), and answers with the slots. Nothing on
that side touches MLX: the MLX thread is busy with the token until the last layer is
answered, so installs go off its thread meanwhile (`ExpertRouter.mlx_busy`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import mlx.core as mx
import numpy as np
import trio

from actors import timeline
from actors.device_wait import Mailboxes
from actors.forward import unique_in_order
from actors.prefetch.actor import Routed
from actors.prefetch.strategies import Prediction
from actors.router import ExpertRouter
from actors.router_types import PullStarved
from actors.run_ahead import RunAheadPolicy
from actors.timer_slack import fine_timer_slack

# How long the event loop sleeps between two looks at a mailbox when it has nothing else
# to do (`published`): against ~0.6 ms of GPU work between two layers (the 35B, H200).
POLL_S = 2e-5
# How long it goes on looking without a trio checkpoint while nothing is runnable.
CHECKPOINT_S = 2e-4


class GateRanking(Protocol):
    """A gate strategy that can publish its ranking from the GPU (actors/prefetch/gate.py)."""

    def ranking(self, layer: int, hidden: mx.array) -> mx.array | None: ...

    def predict_ranked(self, layer: int, ranked: np.ndarray) -> Prediction: ...

    def observe(self, layer: int, chosen: Sequence[int]) -> None: ...


def usable(strategy: Any) -> bool:
    """Whether a prefetch strategy works with tokens queued whole: one that predicts in
    the prefetch task, or a gate that can publish its ranking from the GPU."""
    return not getattr(strategy, "needs_model", False) or hasattr(strategy, "predict_ranked")


def one_row(tokens: Any) -> bool:
    """A lone sequence's decode token (a batch's rows keep the per-layer path)."""
    if isinstance(tokens, mx.array):
        return tokens.size == 1
    return len(tokens) == 1 and (isinstance(tokens[0], int) or len(tokens[0]) == 1)


def launch(wait: Mailboxes, seq: int, make_step: Callable[[], Any], rows: dict[int, int],
           gate: GateRanking | None) -> tuple[Any, Any]:
    """On the MLX thread: build the token (`make_step()`), each MoE layer's slots from its
    wait, and evaluate it: returns once every layer ran (step, run-ahead result).

    The token is built whole before any of it is queued (~10-16 ms of Python on the H200
    before the first layer publishes, session 25): queueing each layer as it is built
    (`async_eval` up to its wait) would overlap that with the GPU, but then this thread
    runs MLX calls while the GPU spins on a wait, and one that blocks on the device with
    the GIL held (a host array's allocation did: docs/results.md, fifteenth pass) keeps
    the event loop from answering: each token waited out the kernel's timeout. Only
    `mx.eval`, which releases the GIL, runs while the GPU waits."""
    with timeline.span("mlx", "build"):
        step = make_step()

        def lookup(layer: int, ids: mx.array, hidden: mx.array) -> mx.array:
            extra = gate.ranking(layer, hidden) if gate is not None else None
            return wait.wait_slots(rows[layer], seq, ids, extra)

        lazy = step.launch_with(lookup)
    with timeline.span("mlx", "eval"):
        mx.eval(lazy.arrays())
    return step, lazy.result()


async def published(wait: Mailboxes, row: int, seq: int) -> float | None:
    """Wait for layer `row` of token `seq` to be published: how long before seeing it the
    last look found it unpublished (0.0: the first look found it), None if the token was
    given up.

    Polled from the event loop. A loop of bare checkpoints held the GIL all the time the
    GPU worked (each checkpoint's epoll gives it back for an instant only, which a waiting
    thread cannot catch): every disk and staging thread then waited out the switch interval
    (0.2 ms) for the GIL after each pread and copy (session 24: the MLX thread 36 % busy,
    the event loop 70 %, a layer's reads late by ~0.9 ms). So when nothing else is ready to
    run it sleeps `POLL_S` with the GIL released: +25-36 % on the page cache, the preads
    0.45-0.51 ms against 0.69-0.74 (H200, docs/results.md fourteenth pass)."""
    last = None
    while not wait.published(row, seq):
        last = time.perf_counter()
        if wait.aborted(seq):
            return None
        await trio.sleep(0)  # a checkpoint: the router, prefetch and readers' completions run
        # Then, while trio has nothing to run, sleep-and-look without a checkpoint between
        # (each one a scheduling round and an epoll call with the GIL held: the event loop
        # spent 62-79 ms of CPU a 110 ms token on the H200, session 26), for at most
        # CHECKPOINT_S (timers and sockets are served at that rate meanwhile).
        until = last + CHECKPOINT_S
        while not wait.published(row, seq):
            now = trio.lowlevel.current_statistics()
            if now.tasks_runnable or now.run_sync_soon_queue_size or time.perf_counter() > until:
                break
            time.sleep(POLL_S)
    return 0.0 if last is None else time.perf_counter() - last


def routed(wait: Mailboxes, row: int, layer: int,
           gate: GateRanking | None) -> tuple[np.ndarray, list[int], Prediction | None]:
    """A published layer: its ids as rows (one token), each expert once in order, and the
    gate's prediction for the next layers (None: the prefetch task predicts)."""
    ids, ranked = wait.routed(row)
    rows, needed = ids.reshape(1, -1), unique_in_order(ids)  # one token of one sequence (`one_row`)
    if gate is None:
        return rows, needed, None
    gate.observe(layer, [int(e) for e in ids])
    return rows, needed, gate.predict_ranked(layer, ranked)


class AwaitStats(Protocol):
    awaited_tokens: int
    awaited_given_up: int
    awaited_layers: int
    awaited_host_seconds: float
    awaited_gap_seconds: float
    awaited_gpu_gap_seconds: float
    awaited_tail_seconds: float
    awaited_back_seconds: float
    awaited_poll_seconds: float
    awaited_gpu_look_seconds: float
    awaited_ready_layers: int


def gpu_clock(stats: AwaitStats, times: np.ndarray) -> None:
    """A token's waits on the GPU's clock ([rows, 4]: published, answer seen, ended, last
    empty look): its work between a layer's end and the next one's publication, the
    copies after each answer, and the last look's length before it (how late the answer
    can have been seen). Nothing where a kernel did not write them (HostWait)."""
    if times.size == 0 or not times[:, :3].all():
        return
    stats.awaited_gpu_gap_seconds += float((times[1:, 0] - times[:-1, 2]).sum()) / 1e9
    stats.awaited_tail_seconds += float((times[:, 2] - times[:, 1]).sum()) / 1e9
    looked = times[:, 3] > 0
    stats.awaited_gpu_look_seconds += float((times[looked, 1] - times[looked, 3]).sum()) / 1e9


class Host(Protocol):
    """What `queued_whole` needs of the compute actor (actors/compute.py)."""

    router: ExpertRouter
    tick: int
    run_ahead: RunAheadPolicy

    @property
    def stats(self) -> AwaitStats: ...

    @property
    def layer_rows(self) -> dict[int, int]: ...

    @property
    def gate_ranking(self) -> GateRanking | None: ...

    async def on_mlx(self, fn: Any, *args: Any) -> Any: ...

    async def demand_layer(self, routed: Routed, then: Callable[[np.ndarray], None] | None = None) -> np.ndarray: ...

    async def finish_from(self, step: Any, miss: int, phase: Any) -> mx.array: ...


async def queued_whole(compute: Host, wait: Mailboxes, make_step: Callable[[], Any]) -> mx.array:
    """One decode token (`make_step()`, on the MLX thread) queued whole, each MoE layer
    waiting for the host's slots: the compute task answers the layers as they are
    published, with the demands the per-layer path makes, while the MLX thread runs the
    token. Installs
    meanwhile are copies the GPU makes (`ExpertRouter.mlx_busy`), listed for the layer
    that waits next: while it waits, or right after its answer. A staging buffer goes
    back once the layer after its list's is published (the list's wait has ended). A
    layer given up (an error, a timeout, `PullStarved`) is redone per layer from there."""
    router, row_of = compute.router, compute.layer_rows
    seq, misses0, rows, gate = wait.next_seq(), router.table.misses, len(row_of), compute.gate_ranking
    done: list[tuple[Any, Any]] = []
    listed: dict[int, tuple[list[tuple[int, int, int]], list[np.ndarray]]] = {}  # by row
    waiting = 0  # the row whose list installs go to (`rows`: none left, made after the token)
    answered = 0.0  # when the last layer was answered (the gap to the next one's publication)

    def pulled(copies: list[tuple[int, int, int]], buffers: list[np.ndarray]) -> None:
        if waiting < rows:
            wait.append(waiting, copies)
        mine = listed.setdefault(waiting, ([], []))
        mine[0].extend(copies)
        mine[1].extend(buffers)

    async def run_token() -> None:
        done.append(await compute.on_mlx(launch, wait, seq, make_step, row_of, gate))

    compute.stats.awaited_tokens += 1
    fine_timer_slack()  # POLL_S sleeps as asked, not 50 us more
    wait.begin()
    router.mlx_busy = router.reader.finisher.hold = True
    router.pulled = pulled
    try:
        # A landing already under way is a staging thread's DMA, which a context sync
        # could hold up while the GPU waits on this task (and `_evicted` takes its lock):
        # it ends first. No other starts while `hold` is set.
        for load in [*router.loads.values(), *router.orphans]:
            if load.land and load.started:
                await load.done.wait()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_token)
            try:
                for row, layer in enumerate(row_of):
                    back = time.perf_counter()
                    late = await published(wait, row, seq)
                    if late is None:
                        break
                    for earlier in [r for r in listed if r < row]:  # their waits have ended
                        for buffer in listed.pop(earlier)[1]:
                            router.reader.give_back(buffer)
                    seen = time.perf_counter()
                    if row:
                        compute.stats.awaited_gap_seconds += seen - answered
                        compute.stats.awaited_back_seconds += back - answered
                        compute.stats.awaited_poll_seconds += late
                    ids_rows, ids, preds = routed(wait, row, layer, gate)
                    compute.tick += 1
                    if all(router.table.ready((layer, e)) for e in ids):
                        compute.stats.awaited_ready_layers += 1

                    def answer(slot_of: np.ndarray, row: int = row, ids_rows: np.ndarray = ids_rows,
                               seen: float = seen) -> None:
                        nonlocal waiting, answered
                        wait.answer(row, seq, slot_of[ids_rows[0]].astype(np.int32))
                        waiting = row + 1
                        answered = time.perf_counter()
                        compute.stats.awaited_layers += 1
                        compute.stats.awaited_host_seconds += answered - seen

                    with timeline.span("compute", "answer", layer=layer):
                        routed_layer = Routed(layer, ids_rows, ids, compute.tick, "decode", predicted=preds)
                        await compute.demand_layer(routed_layer, then=answer)
            except PullStarved:
                wait.abort(seq)  # redone per layer below, once the MLX call returns
            except BaseException:
                wait.abort(seq)  # every wait of the token gives up; the MLX call returns
                raise
    finally:
        router.mlx_busy = router.reader.finisher.hold = False
        router.pulled = None
        # Lists a wait may not have made (given up), or that no wait had (after the
        # last answer): made now, in order, the MLX thread idle.
        owed = [c for r in sorted(listed) if wait.aborted(seq) or r >= rows for c in listed[r][0]]
        if owed:
            assert router.copy_now is not None
            with trio.CancelScope(shield=True):
                await router.copy_now(owed)
        for _, buffers in listed.values():
            for buffer in buffers:
                router.reader.give_back(buffer)
    step, result = done[0]
    miss = result.first_miss()
    if miss is None:
        gpu_clock(compute.stats, wait.gpu_times())
        compute.run_ahead.after_layered(hit=router.table.misses == misses0)
        return cast(mx.array, result.logits)
    compute.stats.awaited_given_up += 1
    return await compute.finish_from(step, miss, "decode")
