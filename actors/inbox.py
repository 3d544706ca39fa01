"""An actor's requests over one bounded channel, served in order by its one task.

The router (actors/router.py) is served so: whoever asks, the requests run one after
the other in the order they were sent, which keeps the state the task owns in one
well-defined order. `ask` waits for the result (its exception re-raised in the asker),
`tell` does not, `try_tell` never waits (dropped when the channel is full).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import outcome
import trio

from actors import timeline


@dataclass
class _Request:
    fn: Callable[..., Awaitable[Any]]
    args: tuple[Any, ...]
    reply: trio.MemorySendChannel[outcome.Outcome[Any]] | None


class Inbox:
    def __init__(self, track: str, size: int) -> None:
        """`track`: the timeline track the requests' spans go on; `size`: requests that
        may wait (a sender waits while the channel is full)."""
        self.track = track
        self._send, self._receive = trio.open_memory_channel[_Request](size)

    def _stopped(self) -> RuntimeError:
        return RuntimeError(f"the {self.track} task has stopped (the engine is closing)")

    async def ask(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        reply, answer = trio.open_memory_channel[outcome.Outcome[Any]](1)
        try:
            await self._send.send(_Request(fn, args, reply))
        except trio.BrokenResourceError:  # the serving task has stopped
            raise self._stopped() from None
        return (await answer.receive()).unwrap()

    async def tell(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """No answer awaited; dropped once the serving task has stopped (closing)."""
        try:
            await self._send.send(_Request(fn, args, None))
        except trio.BrokenResourceError:
            pass

    def try_tell(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        """On the trio thread, without waiting: False if the channel is full (or gone)."""
        try:
            self._send.send_nowait(_Request(fn, args, None))
        except (trio.WouldBlock, trio.BrokenResourceError):
            return False
        return True

    async def serve(self, after: Callable[[], Awaitable[None]]) -> None:
        """Run the requests in order until cancelled; `after()` once each is answered.
        When it stops (the engine closing), the requests still waiting are answered with
        an error and later ones refused: an asker never waits for a task that is gone (a
        cancelled generation's shielded clean-up waited so, and the engine's close with it)."""
        async with self._receive:
            try:
                async for request in self._receive:
                    with timeline.span(self.track, request.fn.__name__.lstrip("_")):
                        result = await outcome.acapture(request.fn, *request.args)
                    if request.reply is not None:
                        # The asker may have been cancelled meanwhile: the reply then waits in
                        # the buffer of a channel nobody reads, and is collected with it.
                        request.reply.send_nowait(result)
                    await after()
            finally:
                gone = outcome.Error(self._stopped())
                while True:
                    try:
                        request = self._receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    if request.reply is not None:
                        request.reply.send_nowait(gone)
