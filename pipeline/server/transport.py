"""How replies go out over HTTP: JSON bodies, SSE streams that close what they hold and
can wait for admission before their status line, and one-shot replies that stop when the
client goes away."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import msgspec
import structlog
import trio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Send

from pipeline.server import schema as s

log = structlog.get_logger("moestream.server")


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status, headers, media_type="application/json")


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body iterator whichever way streaming ends (send failure, disconnect).

    Starlette leaves an unfinished iterator to the garbage collector; ours holds the
    engine's lock and pinned experts, so it must be closed now.

    With `ready`, the status line waits until the generation is admitted (leaves the
    engine's queue): a request refused while queued (the server shutting down) then gets
    its real status (503), not a 200 and an error event. What the body yields meanwhile
    is held and sent after.
    """

    def __init__(self, content: AsyncGenerator[bytes, None], *, ready: trio.Event | None = None,
                 error_body: Callable[[s.APIError], dict[str, Any]] = s.APIError.body,
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.content = content  # starlette's body_iterator, as the generator it is (aclose)
        self.ready = ready
        self.error_body = error_body  # the refusal's shape: OpenAI's, or another API's

    async def stream_response(self, send: Send) -> None:
        async with aclosing(self.content) as body:
            if self.ready is None:
                self.body_iterator = body
                await super().stream_response(send)
                return
            chunks_in, chunks_out = trio.open_memory_channel[bytes](16)
            refused: list[s.APIError] = []
            pulled = trio.Event()

            async def pull() -> None:
                try:
                    async with chunks_in:
                        async for chunk in body:
                            await chunks_in.send(chunk)
                except s.APIError as exc:  # raised only before admission (`Reply.stream`)
                    refused.append(exc)
                finally:
                    pulled.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pull)
                await _first_of(self.ready, pulled)
                if refused and not self.ready.is_set():
                    await _send_json(send, refused[0], self.error_body)
                    return

                async def held() -> AsyncGenerator[bytes, None]:
                    async with chunks_out:
                        async for chunk in chunks_out:
                            yield chunk

                self.body_iterator = held()
                await super().stream_response(send)


async def _first_of(*events: trio.Event) -> None:
    """Return as soon as any of `events` is set."""
    with trio.CancelScope() as scope:
        async def wait(event: trio.Event) -> None:
            await event.wait()
            scope.cancel()

        async with trio.open_nursery() as nursery:
            for event in events:
                nursery.start_soon(wait, event)


async def _send_json(send: Send, error: s.APIError,
                     body: Callable[[s.APIError], dict[str, Any]]) -> None:
    payload = msgspec.json.encode(body(error))
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def unless_disconnected(request: Request, run: Callable[[], Awaitable[Response]]) -> Response:
    """Run a non-streaming generation, cancelled if the client goes away meanwhile."""
    result: list[Response] = []
    error: Exception | None = None
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            log.info("server.client_gone", path=request.url.path)
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        # Raised outside the nursery, so that callers see the error, not an ExceptionGroup.
        try:
            result.append(await run())
        except Exception as exc:
            error = exc
        finally:
            nursery.cancel_scope.cancel()
    if error is not None:
        raise error
    return result[0] if result else Response(status_code=499)


def sse_response(body: AsyncGenerator[bytes, None], ready: trio.Event | None = None) -> Response:
    return ClosingStreamingResponse(body, ready=ready, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache"})


def ndjson_response(body: AsyncGenerator[bytes, None], ready: trio.Event | None = None) -> Response:
    """Ollama's stream: one JSON object a line; a refusal while queued is `{"error": ...}`."""
    return ClosingStreamingResponse(body, ready=ready, error_body=s.APIError.ollama_body,
                                    media_type="application/x-ndjson")
