"""The server's replies: chat and text completions as one JSON body or as SSE chunks.

A request that passed every check (pipeline.server) gets a `ChatReply` or a `TextReply`;
`respond` streams it or, for a one-shot request, runs it to the end unless the client
goes away first. Errors after a stream has started cannot change the status any more,
so they become one final SSE error event.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import msgspec
import structlog
import trio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Send

from actors.sampling_params import SamplingParams
from pipeline.engine import Engine
from pipeline.events import Done, TextDelta
from pipeline.server import schema as s
from pipeline.server.call_formats import Schemas
from pipeline.server.drain import Drain, shutting_down
from pipeline.server.metrics import Metrics
from pipeline.server.tool_calls import Call, Content, OutputParser, Part, Reasoning

# The server's logger: these events are the server's, wherever the code lives.
log = structlog.get_logger("moestream.server")


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status, headers, media_type="application/json")


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body iterator whichever way streaming ends (send failure, disconnect).

    Starlette leaves an unfinished iterator to the garbage collector; ours holds the
    engine's lock and pinned experts, so it must be closed now.
    """

    async def stream_response(self, send: Send) -> None:
        async with aclosing(self.body_iterator) as body:  # type: ignore[type-var]
            self.body_iterator = body
            await super().stream_response(send)


def _usage(done: Done) -> s.Usage:
    st = done.stats
    return s.Usage(st.prompt_tokens, st.completion_tokens, st.prompt_tokens + st.completion_tokens,
                   s.PromptTokensDetails(st.cached_tokens))


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _sse_error(exc: BaseException) -> bytes:
    if isinstance(exc, s.APIError):  # a refusal with its own body (e.g. shutting down)
        log.info("server.stream_ended", status=exc.status, reason=exc.message)
        return _sse(exc.body())
    log.error("server.stream_failed", exc_info=exc)
    body = s.APIError(500, "internal error while generating", type="server_error").body()
    return _sse(body)


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


class Reply:
    prefix = "cmpl"
    drain: Drain | None = None  # the server's shutdown state, set by the app

    def __init__(self, engine: Engine, metrics: Metrics,
                 req: s.ChatRequest | s.CompletionRequest) -> None:
        self.engine = engine
        self.metrics = metrics
        self.req = req
        self.id = f"{self.prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = req.model

    async def run(self, tokens: list[int], params: SamplingParams) -> AsyncIterator[TextDelta | Done]:
        drain = self.drain or Drain()
        drain.started()
        try:
            async with aclosing(self.engine.generate(tokens, params)) as events:
                producing = False
                while True:
                    # Each wait for the next event is cancellable by a shutdown; the yield
                    # stays outside the scope, so a cancel never lands in the consumer.
                    with trio.CancelScope() as scope:
                        drain.watch(scope, producing)
                        try:
                            event = await anext(events)
                        except StopAsyncIteration:
                            return
                        finally:
                            drain.unwatch(scope)
                    if scope.cancelled_caught:
                        raise shutting_down()
                    producing = True
                    if isinstance(event, Done):
                        self.metrics.record_generation(event.stats)
                    yield event
        finally:
            drain.finished()

    def include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    async def complete(self, tokens: list[int], params: SamplingParams) -> Response:
        raise NotImplementedError

    async def stream(self, tokens: list[int], params: SamplingParams) -> AsyncIterator[bytes]:
        """The SSE body: the reply's chunks, then `[DONE]`; a failure mid-stream ends it with
        one error event instead (the status line has long been sent)."""
        try:
            async with aclosing(self.chunks(tokens, params)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except Exception as exc:
            yield _sse_error(exc)
            return
        yield b"data: [DONE]\n\n"

    def chunks(self, tokens: list[int], params: SamplingParams) -> AsyncIterator[bytes]:
        raise NotImplementedError


class ChatReply(Reply):
    prefix = "chatcmpl"

    def __init__(self, engine: Engine, metrics: Metrics, req: s.ChatRequest, *, tools: bool,
                 in_reasoning: bool, hide_reasoning: bool,
                 schemas: Schemas | None = None) -> None:
        super().__init__(engine, metrics, req)
        self.tools = tools
        self.schemas = schemas  # tool name -> parameters schema: types XML-style arguments
        self.in_reasoning = in_reasoning
        self.hide_reasoning = hide_reasoning

    def finish_reason(self, done: Done, parser: OutputParser) -> str:
        return "tool_calls" if parser.calls and done.finish_reason == "stop" else done.finish_reason

    async def complete(self, tokens: list[int], params: SamplingParams) -> Response:
        parser = OutputParser(tools=self.tools, in_reasoning=self.in_reasoning,
                              schemas=self.schemas)
        parts: list[Part] = []
        done = None
        async with aclosing(self.run(tokens, params)) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    parts += parser.feed(event.text)
                else:
                    done = event
        assert done is not None
        parts += parser.finish()
        content = "".join(p.text for p in parts if isinstance(p, Content))
        reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning))
        calls = [s.OutToolCall(c.id, s.OutFunction(c.name, c.arguments))
                 for c in parts if isinstance(c, Call)]
        message = s.OutMessage(
            role="assistant",
            content=(content.strip() or None) if calls else content,
            reasoning_content=None if self.hide_reasoning else (reasoning or None),
            tool_calls=calls or None,
        )
        choice = s.ChatChoice(0, message, self.finish_reason(done, parser))
        return json_response(s.ChatCompletion(self.id, self.created, self.model, [choice],
                                              _usage(done)))

    def chunk(self, delta: s.Delta, finish: str | None = None) -> bytes:
        return _sse(s.ChatChunk(self.id, self.created, self.model,
                                [s.ChunkChoice(0, delta, finish)]))

    def delta(self, part: Part) -> s.Delta | None:
        if isinstance(part, Content):
            return s.Delta(content=part.text)
        if isinstance(part, Reasoning):
            return None if self.hide_reasoning else s.Delta(reasoning_content=part.text)
        call = s.DeltaToolCall(part.index, part.id, "function", s.OutFunction(part.name, part.arguments))
        return s.Delta(tool_calls=[call])

    async def chunks(self, tokens: list[int], params: SamplingParams) -> AsyncIterator[bytes]:
        parser = OutputParser(tools=self.tools, in_reasoning=self.in_reasoning,
                              schemas=self.schemas)
        yield self.chunk(s.Delta(role="assistant", content=""))
        async with aclosing(self.run(tokens, params)) as events:
            async for event in events:
                parts = parser.feed(event.text) if isinstance(event, TextDelta) else parser.finish()
                for part in parts:
                    delta = self.delta(part)
                    if delta is not None:
                        yield self.chunk(delta)
                if isinstance(event, Done):
                    yield self.chunk(s.Delta(), self.finish_reason(event, parser))
                    if self.include_usage():
                        yield _sse(s.ChatChunk(self.id, self.created, self.model, [],
                                               usage=_usage(event)))


class TextReply(Reply):
    async def complete(self, tokens: list[int], params: SamplingParams) -> Response:
        texts: list[str] = []
        done = None
        async with aclosing(self.run(tokens, params)) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    texts.append(event.text)
                else:
                    done = event
        assert done is not None
        choice = s.TextChoice(0, "".join(texts), done.finish_reason)
        return json_response(s.Completion(self.id, self.created, self.model, [choice],
                                          _usage(done)))

    async def chunks(self, tokens: list[int], params: SamplingParams) -> AsyncIterator[bytes]:
        async with aclosing(self.run(tokens, params)) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    if event.text:
                        yield _sse(s.Completion(self.id, self.created, self.model,
                                                [s.TextChoice(0, event.text)]))
                    continue
                yield _sse(s.Completion(self.id, self.created, self.model,
                                        [s.TextChoice(0, "", event.finish_reason)]))
                if self.include_usage():
                    yield _sse(s.Completion(self.id, self.created, self.model, [],
                                            usage=_usage(event)))


async def respond(request: Request, reply: Reply, tokens: list[int],
                  params: SamplingParams) -> Response:
    """SSE for a streaming request; otherwise the whole reply, unless the client leaves."""
    if reply.req.stream:
        return ClosingStreamingResponse(reply.stream(tokens, params),
                                        media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache"})
    return await unless_disconnected(request, lambda: reply.complete(tokens, params))
