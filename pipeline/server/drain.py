"""Shutting the server down without leaving a client guessing.

On SIGTERM/SIGINT: new requests get 503; requests that have not produced a token yet
(waiting for the engine, or just admitted) are stopped and get 503 (a streaming one as
an SSE error event, since its status line is out); replies that are producing tokens
get `grace_s` to finish, then each ends with one SSE error event (or a 503 when not
streaming). Only then does hypercorn close the connections.
"""

from __future__ import annotations

import structlog
import trio

from pipeline.server import schema as s

log = structlog.get_logger("moestream.server")


def shutting_down() -> s.APIError:
    return s.APIError(503, "the server is shutting down; retry the request (elsewhere or "
                      "once it is back)", type="server_error", code="server_shutting_down")


class Drain:
    def __init__(self) -> None:
        self.stopping = False
        self.cut = False
        self._waiting: set[trio.CancelScope] = set()  # no token yet
        self._producing: set[trio.CancelScope] = set()
        self._idle = trio.Event()
        self._idle.set()
        self._active = 0

    def check_open(self) -> None:
        if self.stopping:
            raise shutting_down()

    def started(self) -> None:
        self._active += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle

    def finished(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    def watch(self, scope: trio.CancelScope, producing: bool) -> None:
        """Register the scope a reply waits for its next event in; cancelled when due."""
        if self.cut or (self.stopping and not producing):
            scope.cancel()
        (self._producing if producing else self._waiting).add(scope)

    def unwatch(self, scope: trio.CancelScope) -> None:
        self._waiting.discard(scope)
        self._producing.discard(scope)

    async def shut_down(self, grace_s: float) -> None:
        self.stopping = True
        for scope in self._waiting:
            scope.cancel()
        with trio.move_on_after(grace_s):
            await self._idle.wait()
        self.cut = True
        for scope in self._producing:
            scope.cancel()
        with trio.move_on_after(1.0):
            await self._idle.wait()
        log.info("server.drained", unfinished=self._active)
