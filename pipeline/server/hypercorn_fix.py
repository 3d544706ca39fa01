"""One fix to hypercorn (0.18), applied once before the server starts.

A client that closes an idle keep-alive connection: the connection's task reads the end
of the stream and leaves its read loop, then waits for its task group, in which the
keep-alive timer (`keep_alive_timeout`, 75 s here: pipeline/server/app.py) still runs;
only after it does the socket close. Every connection a client ended while idle (a
health-checking load balancer's every probe, a client's pool at its own expiry) sat in
CLOSE-WAIT holding a descriptor for 75 s (reproduced with a bare starlette app). Here
the timer stops once the read loop has ended: nothing can arrive on that connection
after its end, and a reply still being written keeps the task group open as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from hypercorn.trio.tcp_server import TCPServer

_applied = False


def close_idle_connections_at_eof() -> None:
    """Patch `TCPServer._read_data` (idempotent)."""
    global _applied
    if _applied:
        return
    read_data: Callable[[Any], Awaitable[None]] = TCPServer._read_data

    async def _read_data(self: Any) -> None:
        await read_data(self)
        await self.idle_task.stop()  # the stream ended: no keep-alive left to wait out

    TCPServer._read_data = _read_data  # type: ignore[method-assign]
    _applied = True
