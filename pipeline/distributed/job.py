"""One rank's life in a distributed job: join, run, finish together.

    mlx.launch --hostfile hosts.json -- moestream serve MODEL --distributed

Every rank runs the same command. Each joins the group, shakes hands, and learns its
layers (`Stage.join`); then rank 0 runs the command's face (serve, generate, run, chat:
given the stage, they open the engine with it, which then holds rank 0's layers) while the later ranks
run their stage loop. When the face returns, rank 0 sends `SHUTDOWN` down the chain and
every rank reports its counters to rank 0 (one all_sum), logged as `distributed.stats`.

A lost rank (`RankLost`) ends the job on every rank that notices: the request in flight
fails (503 from the server), the server stops, and the process exits 1 with one
`error:` line, through `os._exit`: a thread blocked in a receive that will never finish
must not hold the exit up.

Stopping: every rank watches its launcher (`launcher_watch`) and sends itself SIGTERM
when it is gone. Rank 0 stops as on any SIGTERM (a server drains) and then tells the
others. A later rank leaves a SIGTERM to rank 0 (a service manager may signal every
process of the job at once, and a later rank that went first would cut rank 0's drain
short with a lost rank); if the job has not ended `server.shutdown_grace_s` +
`FOLLOW_MARGIN_S` later, it exits 1 on its own with one `error:` line.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import numpy as np
import structlog
import trio

from pipeline.config.schema import PipelineConfig
from pipeline.distributed import wire
from pipeline.distributed.errors import RankLost
from pipeline.distributed.launcher_watch import watch_launcher
from pipeline.distributed.link import Link
from pipeline.distributed.stage import Stage
from qpack.reader import Container

log = structlog.get_logger("moestream.distributed")

EXIT_RANK_LOST = 1
# What a later rank told to stop allows rank 0 beyond its drain (the server's grace, the
# cut streams' second, closing the engine, the SHUTDOWN message) before it goes alone.
FOLLOW_MARGIN_S = 10.0
# Counters each rank reports at the end (rows of `distributed.stats`).
STATS_FIELDS = ("forwards", "tokens", "boundary_s", "busy_s", "bytes_sent", "decode_forwards",
                "decode_boundary_s", "decode_busy_s", "hits", "misses", "reads", "bytes_read")

_link: Link | None = None


def process_link(backend: str) -> Link:
    """The process's link, made once: a process is one rank for its whole life."""
    global _link
    if _link is None:
        _link = Link.join(backend)
    return _link


def join(cfg: PipelineConfig) -> Stage:
    link = process_link(cfg.distributed.backend)
    container = Container.open(Path(cfg.model.path), verify="off")
    try:
        return Stage.join(link, container, cfg.distributed)
    finally:
        container.close()


def run_distributed(cfg: PipelineConfig, face: Callable[[PipelineConfig, Stage], int], *,
                    stop_on_loss: bool = False) -> int:
    """Run this rank's part of `face`; its exit status. Rank 0 runs `face(cfg, stage)`,
    which opens its engine with `open_engine(cfg, stage=stage)`. `stop_on_loss`: a lost
    rank sends this process SIGTERM (a server then stops as on Ctrl-C, after its 503s)."""
    watch_launcher()  # before the join, which waits for the other ranks as long as it takes
    stage = join(cfg)
    if stop_on_loss and stage.plan.first:
        stage.link.on_broken = _terminate_soon
    status = 0
    try:
        if stage.plan.first:
            failed = True
            try:
                status = face(cfg, stage)
                failed = False
            finally:
                # Also after the face failed (a bad prompt, Ctrl-C): the later ranks then
                # stop cleanly instead of finding rank 0 gone. Its own error is then the one
                # to report: a later rank that failed too is lost by then, and that is not news.
                if stage.link.broken is None:
                    stage.shutdown()
                    try:
                        report(finish(stage))
                    except RankLost:
                        if not failed:
                            raise
        else:
            # Ctrl-C in a terminal reaches every local rank of an mlx.launch job: rank 0
            # decides (a chat stops its reply, a server drains) and tells the others.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, _follower(stage, cfg.server.shutdown_grace_s
                                                    + FOLLOW_MARGIN_S))
            trio.run(_stage_loop, cfg, stage)
            finish(stage)
    except RankLost as exc:
        _exit_lost(stage, str(exc))
    except BaseException:
        if stage.link.broken is None:
            raise
        _exit_lost(stage, stage.link.broken)
    if stage.link.broken is not None:
        _exit_lost(stage, stage.link.broken)
    return status


async def _stage_loop(cfg: PipelineConfig, stage: Stage) -> None:
    from pipeline.distributed.worker import StageLoop
    from pipeline.engine_open import open_core

    async with open_core(cfg, stage=stage) as core:
        await StageLoop(core, stage).run()


def finish(stage: Stage) -> np.ndarray:
    """Every rank's counters (the same [size, fields] table on every rank)."""
    s = stage.stats
    table = stage.pool_counters()
    row = np.array([s.forwards, s.tokens, s.seconds, s.busy_seconds, s.bytes_sent,
                    s.decode_forwards, s.decode_seconds, s.decode_busy_seconds, *table])
    link = stage.link
    return link.call(lambda: wire.all_rows(row, link.rank, link.size),
                     timeout=stage.settings.peer_timeout_s, what="final counters")


def report(table: np.ndarray) -> list[dict[str, float]]:
    rows = [dict(zip(STATS_FIELDS, (float(v) for v in row), strict=True)) for row in table]
    for rank, row in enumerate(rows):
        log.info("distributed.stats", rank=rank, **{k: round(v, 4) for k, v in row.items()})
    return rows


def _follower(stage: Stage, within_s: float) -> Callable[[int, FrameType | None], None]:
    """A later rank's SIGTERM handler: rank 0 (told too, or about to find this rank's
    launcher gone as well) ends the job; past `within_s` this rank goes alone. The handler
    only sets an event: it runs between any two bytecodes of the main thread, which may be
    in the middle of writing a log line itself."""
    told: list[int] = []
    event = threading.Event()

    def follow() -> None:
        event.wait()
        name = signal.Signals(told[0]).name
        log.info("distributed.stop_requested", rank=stage.plan.rank, signal=name,
                 within_s=within_s)
        time.sleep(within_s)
        _exit_lost(stage, f"told to stop ({name}) and rank 0 did not end the job within "
                   f"{within_s:g} s")

    threading.Thread(target=follow, name="moestream-follow-rank-0", daemon=True).start()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        told.append(signum)
        event.set()

    return on_signal


def _terminate_soon() -> None:
    # After a beat, so the request that found the loss gets its 503 out first.
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()


def exit_now(status: int) -> None:
    """A rank whose part is done leaves at once: the interpreter's teardown of MLX, torch
    and transformers took 3-7 s on the 2-core VM, which a stopping job (and its service
    manager's timeout) would wait for. atexit's functions still run (they take ms)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # nobody reads our output any more
        pass
    atexit._run_exitfuncs()
    os._exit(status)


def _exit_lost(stage: Stage, reason: str) -> None:
    try:
        print(f"error: rank {stage.plan.rank}: {reason}", file=sys.stderr, flush=True)
        sys.stdout.flush()
    except (OSError, ValueError):  # nobody reads our output any more: exit all the same
        pass
    os._exit(EXIT_RANK_LOST)
