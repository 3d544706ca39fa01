"""The sampling task: from a sampled token id to text the caller may see.

Compute draws the token on the MLX thread (in the same evaluation as the step that
produced its logits, so decode stays one host sync per token) and hands the id to this
task, which owns the text side of sampling: the streaming detokenizer, stop strings and
stop ids (`TextStream`), and the delivery of each text delta to the caller's channel.
Its answer, whether the token ended the generation, comes back before compute consumes
the next token; the GPU is meanwhile busy with the step already queued on this token.

A caller that stops reading blocks delivery (the channel is bounded) and so, in turn,
decoding: nothing piles up. A caller that is gone ends the generation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import outcome
import trio

from actors.text_stream import FinishReason, TextStream

# emit(text, token or None for a tail without its own token)
Emit = Callable[[str, int | None], Awaitable[None]]


class CallerGone(Exception):
    """The generation's reader closed its channel: stop generating."""


@dataclass
class _Token:
    stream: TextStream
    token: int | None  # None: finish the stream ("length")
    emit: Emit
    reply: trio.MemorySendChannel[outcome.Outcome[FinishReason | None]]


class SamplingTask:
    def __init__(self, buffer: int = 4) -> None:
        self._send, self._receive = trio.open_memory_channel[_Token](buffer)

    async def run(self) -> None:
        async with self._receive:
            async for item in self._receive:
                item.reply.send_nowait(await outcome.acapture(self._handle, item))

    async def _handle(self, item: _Token) -> FinishReason | None:
        if item.token is None:
            text, reason = item.stream.finish("length"), None
        else:
            text, reason = item.stream.add(item.token)
        if text:
            try:
                await item.emit(text, item.token)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise CallerGone("the caller stopped reading") from None
        return reason

    async def add(self, stream: TextStream, token: int, emit: Emit) -> FinishReason | None:
        """Stream `token`'s text (if any) to `emit`; its finish reason, or None to go on."""
        return await self._ask(stream, token, emit)

    async def finish(self, stream: TextStream, emit: Emit) -> None:
        """End a stream that ran out of tokens: emit the text still held back."""
        await self._ask(stream, None, emit)

    async def _ask(self, stream: TextStream, token: int | None, emit: Emit) -> FinishReason | None:
        reply, answer = trio.open_memory_channel[outcome.Outcome[FinishReason | None]](1)
        await self._send.send(_Token(stream, token, emit, reply))
        return (await answer.receive()).unwrap()
