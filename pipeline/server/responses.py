"""The server's replies: chat and text completions as one JSON body or as SSE chunks.

A request that passed every check (api.py, routes_openai.py) gets a `ChatReply` or a
`TextReply` over its `Choice`s (n per prompt, generated one after another); `respond`
streams it or, for a one-shot request, runs it to the end unless the client goes away
first. Errors after a stream has started cannot change the status any more, so they
become one final SSE error event. With logprobs requested, each choice (or chunk) carries
the log-probabilities of its tokens. The Responses and Anthropic routes reuse
`ChatReply.parts` and write their own wire forms.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager

import msgspec
import structlog
import trio
from starlette.requests import Request
from starlette.responses import Response

from actors.sampling_params import SamplingParams
from actors.token_logprob import TokenLogprob
from pipeline.engine import Engine
from pipeline.events import Done, TextDelta
from pipeline.fingerprint import fingerprint
from pipeline.generation import Generation
from pipeline.server import schema as s
from pipeline.server import schema_out as o
from pipeline.server.call_formats import Schemas
from pipeline.server.drain import Drain, shutting_down
from pipeline.server.logprobs import TextLogprobs, TokenTexts, chat_logprobs, text_logprobs
from pipeline.server.metrics import Metrics
from pipeline.server.tool_calls import Call, Content, OutputParser, Part, Reasoning
from pipeline.server.transport import json_response, sse, sse_response, unless_disconnected

# The server's logger: these events are the server's, wherever the code lives.
log = structlog.get_logger("moestream.server")


def _sse_error(exc: BaseException) -> bytes:
    return sse(s.stream_failure(exc).body())


class Choice(msgspec.Struct, frozen=True):
    """One generation of a reply: choice `index` of prompt `tokens` (n > 1 and prompt lists
    give several; they are submitted together and decode in one batch)."""

    index: int
    tokens: list[int]
    params: SamplingParams
    first_of_prompt: bool = True  # counts the prompt in usage (once per prompt, not per n)


def _usage_of(dones: list[tuple[Choice, Done]]) -> o.Usage:
    prompt = sum(len(c.tokens) for c, _ in dones if c.first_of_prompt)
    cached = sum(d.stats.cached_tokens for c, d in dones if c.first_of_prompt)
    completion = sum(d.stats.completion_tokens for _, d in dones)
    return o.Usage(prompt, completion, prompt + completion, o.PromptTokensDetails(cached))


class Reply:
    prefix = "cmpl"
    drain: Drain | None = None  # the server's shutdown state, set by the app

    def __init__(self, engine: Engine, metrics: Metrics, req: s.ChatRequest | s.CompletionRequest,
                 model: str, choices: list[Choice]) -> None:
        self.engine = engine
        self.metrics = metrics
        self.req = req
        self.id = f"{self.prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint(engine.container.root)
        self.choices = choices
        self.texts = TokenTexts(engine.tokenizer)
        self.admitted = trio.Event()  # the first generation left the engine's queue
        self.started: dict[int, Generation] = {}
        # A choice of this reply produced a token: its later choices (read one after the
        # other) are a reply producing too, which a shutdown lets finish within its grace.
        self.producing = False

    @asynccontextmanager
    async def batched(self) -> AsyncIterator[None]:
        """Submit every choice's generation at once (they decode in one batch, each read
        in turn); whichever way the reply ends, the ones not read to the end are stopped.
        The drain counts the reply whole (between two choices it is not idle)."""
        if self.drain is not None:
            self.drain.started()
        try:
            if len(self.choices) > 1:  # within the try: a later one refused stops the earlier
                for choice in self.choices:
                    self.started[choice.index] = self.engine.start(
                        choice.tokens, choice.params, admitted=self.admitted)
            yield
        finally:
            with trio.CancelScope(shield=True):
                for generation in self.started.values():
                    await generation.close()
            if self.drain is not None:
                self.drain.finished()

    async def run(self, choice: Choice) -> AsyncGenerator[TextDelta | Done, None]:
        drain = self.drain or Drain()
        drain.started()
        try:  # a refused start too ends what the drain counts
            generation = self.started.get(choice.index) or self.engine.start(
                choice.tokens, choice.params, admitted=self.admitted)
            async with aclosing(generation.run()) as events:
                while True:
                    # Each wait for the next event is cancellable by a shutdown; the yield
                    # stays outside the scope, so a cancel never lands in the consumer.
                    with trio.CancelScope() as scope:
                        drain.watch(scope, self.producing)
                        try:
                            event = await anext(events)
                        except StopAsyncIteration:
                            return
                        finally:
                            drain.unwatch(scope)
                    if scope.cancelled_caught:
                        raise shutting_down()
                    self.producing = True
                    if isinstance(event, Done):
                        self.metrics.record_generation(event.stats)
                    yield event
        finally:
            drain.finished()

    def include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    async def complete(self) -> Response:
        raise NotImplementedError

    async def stream(self) -> AsyncGenerator[bytes, None]:
        """The SSE body: the reply's chunks, then `[DONE]`; a failure mid-stream ends it with
        one error event instead (the status line has long been sent)."""
        try:
            async with aclosing(self.chunks()) as chunks:
                async for chunk in chunks:
                    yield chunk
        except Exception as exc:
            if isinstance(exc, s.APIError) and not self.admitted.is_set():
                raise  # still queued: the response can answer with its own status
            yield _sse_error(exc)
            return
        yield b"data: [DONE]\n\n"

    def chunks(self) -> AsyncGenerator[bytes, None]:
        raise NotImplementedError


class ChatReply(Reply):
    prefix = "chatcmpl"

    def __init__(self, engine: Engine, metrics: Metrics, req: s.ChatRequest, model: str,
                 choices: list[Choice], *, tools: bool, in_reasoning: bool,
                 hide_reasoning: bool, schemas: Schemas | None = None) -> None:
        super().__init__(engine, metrics, req, model, choices)
        self.tools = tools
        self.schemas = schemas  # tool name -> parameters schema: types XML-style arguments
        self.in_reasoning = in_reasoning
        self.hide_reasoning = hide_reasoning
        self.logprobs = bool(req.logprobs)

    def finish_reason(self, done: Done, parser: OutputParser) -> str:
        return "tool_calls" if parser.calls and done.finish_reason == "stop" else done.finish_reason

    def parser(self) -> OutputParser:
        return OutputParser(tools=self.tools, in_reasoning=self.in_reasoning,
                            schemas=self.schemas)

    async def parts(self, choice: Choice) -> AsyncGenerator[Part | Done, None]:
        """The choice's output as parsed parts, then its `Done` (for the other APIs' replies)."""
        parser = self.parser()
        async with aclosing(self.run(choice)) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    for part in parser.feed(event.text):
                        yield part
                else:
                    for part in parser.finish(cut=event.finish_reason == "length"):
                        yield part
                    yield event

    async def one(self, choice: Choice) -> tuple[o.ChatChoice, Done]:
        parser = self.parser()
        parts: list[Part] = []
        entries: list[TokenLogprob] = []
        done = None
        async with aclosing(self.run(choice)) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    parts += parser.feed(event.text)
                    entries += event.logprobs
                else:
                    done = event
        assert done is not None
        parts += parser.finish(cut=done.finish_reason == "length")
        content = "".join(p.text for p in parts if isinstance(p, Content))
        reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning))
        calls = [o.OutToolCall(c.id, o.OutFunction(c.name, c.arguments))
                 for c in parts if isinstance(c, Call)]
        message = o.OutMessage(
            role="assistant",
            content=(content.strip() or None) if calls else content,
            reasoning_content=None if self.hide_reasoning else (reasoning or None),
            tool_calls=calls or None,
        )
        lp = chat_logprobs(entries, self.texts) if self.logprobs else None
        return o.ChatChoice(choice.index, message, self.finish_reason(done, parser), lp), done

    async def complete(self) -> Response:
        out, dones = [], []
        async with self.batched():
            for choice in self.choices:
                made, done = await self.one(choice)
                out.append(made)
                dones.append((choice, done))
        return json_response(o.ChatCompletion(self.id, self.created, self.model,
                                              self.fingerprint, out, _usage_of(dones)))

    def chunk(self, index: int, delta: o.Delta, finish: str | None = None,
              entries: list[TokenLogprob] | None = None) -> bytes:
        lp = chat_logprobs(entries, self.texts) if self.logprobs and entries else None
        return sse(o.ChatChunk(self.id, self.created, self.model, self.fingerprint,
                                [o.ChunkChoice(index, delta, finish, lp)]))

    def delta(self, part: Part) -> o.Delta | None:
        if isinstance(part, Content):
            return o.Delta(content=part.text)
        if isinstance(part, Reasoning):
            return None if self.hide_reasoning else o.Delta(reasoning_content=part.text)
        call = o.DeltaToolCall(part.index, part.id, "function", o.OutFunction(part.name, part.arguments))
        return o.Delta(tool_calls=[call])

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        dones = []
        async with self.batched():
            for choice in self.choices:
                parser = self.parser()
                # Log-probabilities ride on the next chunk sent (held-back text delays them).
                pending: list[TokenLogprob] = []
                yield self.chunk(choice.index, o.Delta(role="assistant", content=""))
                async with aclosing(self.run(choice)) as events:
                    async for event in events:
                        if isinstance(event, TextDelta):
                            parts = parser.feed(event.text)
                            pending += event.logprobs
                        else:
                            parts = parser.finish(cut=event.finish_reason == "length")
                        for part in parts:
                            delta = self.delta(part)
                            if delta is not None:
                                yield self.chunk(choice.index, delta, None, pending)
                                pending = []
                        if isinstance(event, Done):
                            dones.append((choice, event))
                            yield self.chunk(choice.index, o.Delta(),
                                             self.finish_reason(event, parser), pending)
        if self.include_usage():
            yield sse(o.ChatChunk(self.id, self.created, self.model, self.fingerprint, [],
                                   usage=_usage_of(dones)))


class TextReply(Reply):
    def __init__(self, engine: Engine, metrics: Metrics, req: s.CompletionRequest, model: str,
                 choices: list[Choice]) -> None:
        super().__init__(engine, metrics, req, model, choices)
        self.logprobs = req.logprobs is not None
        self.echo = bool(req.echo)

    def echoed(self, choice: Choice) -> str:
        return self.engine.tokenizer.decode(choice.tokens) if self.echo else ""

    def text_logprobs(self, choice: Choice, entries: list[TokenLogprob], first: bool,
                      offset: int, prompt: tuple[TokenLogprob, ...] = ()) -> TextLogprobs | None:
        if not self.logprobs:
            return None
        # Echoed prompt tokens come first: the first has no log-probability (nothing comes
        # before it), the others the model's, computed for this request (`prompt`).
        lead: list[TokenLogprob | int] = []
        if self.echo and first:
            lead = [*choice.tokens[:1], *prompt] if prompt else list(choice.tokens)
        return text_logprobs([*lead, *entries], self.texts, offset)

    async def complete(self) -> Response:
        out, dones = [], []
        async with self.batched():
            for choice in self.choices:
                texts: list[str] = []
                entries: list[TokenLogprob] = []
                prompt: tuple[TokenLogprob, ...] = ()
                done = None
                async with aclosing(self.run(choice)) as events:
                    async for event in events:
                        if isinstance(event, TextDelta):
                            texts.append(event.text)
                            entries += event.logprobs
                            prompt = prompt or event.prompt_logprobs
                        else:
                            done = event
                assert done is not None
                dones.append((choice, done))
                out.append(o.TextChoice(choice.index, self.echoed(choice) + "".join(texts),
                                        done.finish_reason,
                                        self.text_logprobs(choice, entries, True, 0, prompt)))
        return json_response(o.Completion(self.id, self.created, self.model, self.fingerprint, out,
                                          _usage_of(dones)))

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        dones = []
        async with self.batched():
            for choice in self.choices:
                first, offset = True, 0
                # With logprobs the echo waits for the prompt's own (the first event, sent
                # after prefill); without, it goes out at once.
                echo_now = self.echo and not self.logprobs
                if echo_now:
                    echoed = self.echoed(choice)
                    yield sse(o.Completion(self.id, self.created, self.model, self.fingerprint,
                                            [o.TextChoice(choice.index, echoed, None, None)]))
                    first, offset = False, len(echoed)
                # Log-probabilities of tokens without text ride on the next chunk sent.
                pending: list[TokenLogprob] = []
                async with aclosing(self.run(choice)) as events:
                    async for event in events:
                        if first and self.echo and not echo_now:
                            echoed = self.echoed(choice)
                            prompt = event.prompt_logprobs if isinstance(event, TextDelta) else ()
                            lp = self.text_logprobs(choice, [], True, 0, prompt)
                            yield sse(o.Completion(self.id, self.created, self.model,
                                                   self.fingerprint,
                                                   [o.TextChoice(choice.index, echoed, None, lp)]))
                            first, offset = False, len(echoed)
                        if isinstance(event, TextDelta):
                            pending += event.logprobs
                            if event.text:
                                lp = self.text_logprobs(choice, pending, first, offset)
                                first, offset, pending = False, offset + len(event.text), []
                                yield sse(o.Completion(self.id, self.created, self.model,
                                                       self.fingerprint,
                                                       [o.TextChoice(choice.index, event.text,
                                                                     None, lp)]))
                            continue
                        dones.append((choice, event))
                        lp = self.text_logprobs(choice, pending, first, offset) if pending else None
                        yield sse(o.Completion(self.id, self.created, self.model, self.fingerprint,
                                                [o.TextChoice(choice.index, "",
                                                              event.finish_reason, lp)]))
        if self.include_usage():
            yield sse(o.Completion(self.id, self.created, self.model, self.fingerprint, [],
                                    usage=_usage_of(dones)))


async def respond(request: Request, reply: Reply) -> Response:
    """SSE for a streaming request; otherwise the whole reply, unless the client leaves."""
    if reply.req.stream:
        return sse_response(reply.stream(), ready=reply.admitted)
    return await unless_disconnected(request, reply.complete)
