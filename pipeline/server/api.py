"""What every route shares: the checks a request passes before a reply starts (auth, body
size, JSON, fields, model, prompt length, queue), and the request -> generation knobs.

Every check runs before the status line is sent, so a refusal is a proper error body
with the right status; once a stream has started only an error event is left.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
import trio
from starlette.requests import Request

from actors.sampling_params import SamplingParams
from pipeline.engine import Engine
from pipeline.fingerprint import fingerprint
from pipeline.generation import PromptTooLong
from pipeline.server import grammar
from pipeline.server import schema as s
from pipeline.server.drain import Drain
from pipeline.server.metrics import Metrics
from pipeline.server.offload import Offload
from pipeline.server.settings import ServerSettings

log = structlog.get_logger("moestream.server")

MAX_CHOICES = 32  # n x prompts in one request: each a whole generation, decoded together
BODY_TIMEOUT_S = 30.0  # for a request's body, once its headers are in (then a 408)


class Api:
    def __init__(self, engine: Engine, settings: ServerSettings, metrics: Metrics,
                 drain: Drain | None = None) -> None:
        self.engine = engine
        self.settings = settings
        # A request's sampling defaults, resolved once for every request.
        self.defaults: SamplingParams = (engine.default_params() if settings.defaults is None
                                         else settings.defaults)
        self.metrics = metrics
        self.drain = drain or Drain()
        self.created = int(time.time())
        # Template rendering and tokenizing: worker threads, bounded in time and number.
        self.offload = Offload(self.drain, settings.prompt_budget_s)

    async def encode(self, text: str, param: str) -> list[int]:
        """The tokens of request text, tokenized off the event loop within its budget."""
        return await self.offload(lambda: self.engine.encode(text), "tokenizing the prompt", param)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.engine.container.root)

    @property
    def vocab(self) -> int:
        return self.engine.facts.vocab_size

    def authorized(self, request: Request) -> bool:
        try:
            self.check_auth(request)
        except s.APIError:
            return False
        return True

    def check_auth(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        # Anthropic clients send the key as `x-api-key`.
        given = given if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise s.APIError(401, "missing or incorrect API key: send `Authorization: Bearer <key>`",
                             code="invalid_api_key")

    async def read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise s.APIError(400, f"Content-Length {length!r} is not a byte count")
            if int(length) > limit:
                raise s.APIError(413, f"request body of {length} bytes is over the limit of "
                                 f"{limit} bytes", code="request_too_large")
        chunks: list[bytes] = []
        total = 0
        # hypercorn stops its idle timer once the headers are in: a body that never comes
        # would hold its connection (and a file descriptor) for good.
        with trio.move_on_after(BODY_TIMEOUT_S) as waited:
            async for chunk in request.stream():
                total += len(chunk)
                if total > limit:
                    raise s.APIError(413, f"request body is over the limit of {limit} bytes",
                                     code="request_too_large")
                chunks.append(chunk)
        if waited.cancelled_caught:
            raise s.APIError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s "
                             f"({total} bytes came)", code="request_timeout")
        return b"".join(chunks)

    async def decode(self, request: Request, kind: type[Any]) -> Any:
        """Auth, then the body as `kind`; unknown fields are ignored and logged at debug."""
        self.check_auth(request)
        body = await self.read_body(request)
        req = s.decode_request(body, kind)
        unknown = s.unknown_fields(body, kind)
        if unknown:
            log.debug("server.unknown_fields_ignored", path=request.url.path, fields=unknown)
        return req

    def listed_names(self) -> list[str]:
        return [self.engine.name, *(a for a in self.settings.aliases if a != self.engine.name)]

    def model_names(self) -> set[str]:
        root = str(self.engine.container.root)
        return {*self.listed_names(), root, root.rstrip("/"), *self.settings.accepted}

    def check_model(self, model: str | None) -> str:
        """The name the reply reports: the one asked for, else the first `--alias` (what
        llama.cpp reports), else this model's own."""
        if model is None or model == "":
            return self.settings.aliases[0] if self.settings.aliases else self.engine.name
        if model not in self.model_names():
            if self.settings.strict_model:
                raise s.APIError(404, f"the model {model!r} does not exist; this server serves "
                                 f"{self.engine.name!r}", param="model", code="model_not_found")
            log.debug("server.model_name_ignored", model=model, serving=self.engine.name)
        return model

    def check_prompt(self, tokens: list[int], params: SamplingParams, param: str,
                     generations: int = 1) -> None:
        """`generations`: how many the request queues (n x prompts): each waits in the
        engine's queue, so each counts against `server.max_queue`."""
        try:
            self.engine.check(tokens, params)
        except PromptTooLong as exc:
            raise s.APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        except ValueError as exc:
            raise s.APIError(400, str(exc), param=param) from None
        self.drain.check_open()
        # An empty queue takes any one request (MAX_CHOICES bounds it): else one larger
        # than the queue would be refused for good.
        if self.engine.waiting and self.engine.waiting + generations > self.settings.max_queue:
            raise s.APIError(429, f"the server is busy: {self.engine.waiting} requests are "
                             "waiting; retry later", type="rate_limit_error", code="queue_full")

    def limit_tokens(self, req: s.ChatRequest | s.CompletionRequest,
                     params: SamplingParams) -> SamplingParams:
        """Refuse a completion longer than the server allows; cap one that names no length."""
        limit = self.settings.max_tokens_limit
        named = getattr(req, "max_completion_tokens", None)
        if named is None and req.max_tokens is None:
            return msgspec.structs.replace(params, max_tokens=min(params.max_tokens or limit, limit))
        if params.max_tokens is not None and params.max_tokens > limit:
            param = "max_completion_tokens" if named is not None else "max_tokens"
            raise s.APIError(400, f"{param} is {params.max_tokens}, over this server's limit of "
                             f"{limit} tokens per request (server.max_tokens_limit)", param=param)
        return params

    def params(self, req: s.ChatRequest | s.CompletionRequest) -> SamplingParams:
        params = self.limit_tokens(req, s.sampling_params(req, self.defaults))
        logprobs: int | None = None
        prompt: int | None = None
        if isinstance(req, s.ChatRequest):
            if req.logprobs:
                logprobs = req.top_logprobs or 0
        else:
            logprobs = req.logprobs
            if req.echo:  # the echoed prompt's log-probabilities are the model's too
                prompt = logprobs
        # A request's logit_bias replaces the config's ([sampling] logit_bias); none keeps it.
        bias = params.logit_bias if req.logit_bias is None else s.logit_bias(req, self.vocab)
        return msgspec.structs.replace(params, logit_bias=bias,
                                       logprobs=logprobs, prompt_logprobs=prompt)

    async def constraint(self, grammar_text: str | Callable[[], str],
                         param: str) -> Callable[[], Any]:
        """A factory of fresh grammar constraints; a grammar that does not compile is a 400."""
        eos = self.engine.tokenizer.eos_token_ids
        root = self.engine.container.root

        def build() -> Callable[[], Any]:
            text = grammar_text if isinstance(grammar_text, str) else grammar_text()
            tok = grammar.tokenizer_for(root, self.vocab, eos)
            return grammar.compile_constraint(tok, text, self.vocab, eos)

        try:
            # Compiling a schema and (once) the tokenizer take up to a second or so.
            return await trio.to_thread.run_sync(build)
        except grammar.GrammarError as exc:
            raise s.APIError(400, f"cannot constrain output to it: {exc}", param=param) from None
        except Exception as exc:  # llguidance's own errors for schemas it cannot handle
            raise s.APIError(400, f"cannot constrain output to it: {str(exc)[:400]}",
                             param=param) from None
        except BaseException as exc:
            # A Rust panic reaches Python as pyo3's PanicException, a BaseException: still
            # this request's schema at fault, not the server's state.
            if type(exc).__name__ != "PanicException":
                raise
            log.warning("server.grammar_panic", param=param, error=str(exc)[:400])
            raise s.APIError(400, "cannot constrain output to it: the grammar engine failed "
                             "on this schema", param=param) from None

    def choice_params(self, params: SamplingParams, n: int, count: int,
                      make_constraint: Callable[[], Any] | None) -> list[SamplingParams]:
        """Knobs for `count` choices: a fresh grammar state each, and, with a seed, seed + i
        so that n > 1 choices differ yet replay."""
        if count > MAX_CHOICES:
            raise s.APIError(400, f"n x prompts is {count}; at most {MAX_CHOICES} choices per "
                             "request", param="n")
        out = []
        for i in range(count):
            seed = None if params.seed is None else params.seed + (i % n)
            constraint = make_constraint() if make_constraint is not None else None
            out.append(msgspec.structs.replace(params, seed=seed, constraint=constraint))
        return out
