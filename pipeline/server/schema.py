"""The OpenAI wire format, requests: structs, decoding that names the failing field, errors.

Known fields are decoded with their types checked (a wrong type is a 400 naming the
field); unknown fields are accepted and ignored, as OpenAI's own server and the usual
local servers do, because agent frameworks send vendor fields (`cache_prompt`,
`n_predict`, ...). `unknown_fields` names them for a debug log line. `APIError`
carries the OpenAI error body `{"error": {"message", "type", "param", "code"}}` and
its status.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec
import structlog

from actors.sampling_params import SCALAR_KNOBS, SamplingParams
from pipeline.container_damage import find_damaged


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def ollama_body(self) -> dict[str, Any]:
        return {"error": self.message}

    def anthropic_body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error"}.get(self.status)
        if kind is None:
            kind = "api_error" if self.status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": self.message}}


# --- requests ----------------------------------------------------------------------------


class _Req(msgspec.Struct, kw_only=True):
    pass


class ContentPart(msgspec.Struct, kw_only=True):
    # Not strict on fields: an image part carries `image_url`, and the error should say
    # the part type is unsupported rather than that `image_url` is an unknown field.
    type: str
    text: str | None = None


class FunctionCall(_Req, kw_only=True):
    name: str
    arguments: str


class ToolCall(_Req, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Req, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Req, kw_only=True, omit_defaults=True):  # unset keys stay out of the prompt
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Req, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Req, kw_only=True):
    name: str


class NamedToolChoice(_Req, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Req, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Req, kw_only=True):
    name: str = "response"
    description: str | None = None
    # `schema` shadows nothing on msgspec structs, but keep the wire name explicit.
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(_Req, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # llama.cpp: `{"type": "json_object", "schema": {...}}` constrains to that schema.
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")


class _Sampling(_Req, kw_only=True):
    model: str | None = None  # optional: this server serves one model
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # llama.cpp's own constraints: a JSON schema, or a GBNF grammar, for the reply's text.
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    # moestream: speculative decoding for this request ("auto", "mtp", "ngram", "off").
    speculative: Literal["auto", "mtp", "ngram", "off"] | None = None
    # Accepted and ignored: they change nothing a client can observe here.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # vLLM/SGLang: extra variables for the chat template (e.g. enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM: False leaves the assistant turn unopened (e.g. with continue_final_message).
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # One string, token ids, or a list of either (one choice set per prompt).
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


_PATH = re.compile(r"at `\$\.?(?P<path>[^`]*)`")


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode `body` into `kind`; every failure is a 400 `APIError` naming the field."""
    if not body.strip():
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # an ignored field nested thousands deep
        raise APIError(400, "the request body is nested too deeply") from None


def convert_request(obj: Any, kind: type[msgspec.Struct]) -> Any:
    """`obj` (built from another API's request) as `kind`; failures as `decode_request`'s."""
    try:
        return msgspec.convert(obj, type=kind)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: msgspec.ValidationError) -> APIError:
    text = str(exc)
    match = _PATH.search(text)
    param = match.group("path") if match else None
    missing = re.match(r"Object missing required field `(\w+)`", text)
    if missing:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    return APIError(400, f"invalid request: {text}", param=param)


def damage_error(exc: BaseException) -> APIError | None:
    """A generation that needed a damaged expert: 503 with the damage and the fix (the
    server cannot serve it until the container is mended; /health says so too)."""
    damaged = find_damaged(exc)
    if damaged is None:
        return None
    return APIError(503, str(damaged), type="server_error", code="container_damaged")


def stream_failure(exc: BaseException) -> APIError:
    """What a stream that fails after its status line reports in its last event: a refusal
    with its own body as it is (e.g. the server shutting down), anything else as a logged,
    generic 500."""
    log = structlog.get_logger("moestream.server")
    if isinstance(exc, APIError):
        log.info("server.stream_ended", status=exc.status, reason=exc.message)
        return exc
    if (damaged := damage_error(exc)) is not None:
        log.warning("server.container_damaged", reason=damaged.message)
        return damaged
    log.error("server.stream_failed", exc_info=exc)
    return APIError(500, "internal error while generating", type="server_error")


def unknown_fields(body: bytes, kind: type[msgspec.Struct]) -> list[str]:
    """Top-level keys of a decoded-ok `body` that `kind` does not know (for a debug log)."""
    try:
        # Values stay raw: an ignored field's value is never checked (not even its UTF-8).
        raw = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, RecursionError):  # an ignored key that is not valid text
        return ["<undecodable>"]
    known = set(kind.__struct_encode_fields__)
    return sorted(k for k in raw if k not in known)


MAX_N = 8  # choices per request: each one is a whole generation (they decode in one batch)
MAX_TOP_LOGPROBS = 20


def check_unsupported(req: ChatRequest | CompletionRequest) -> None:
    """Options the API defines with values this server cannot honour: refuse, never ignore."""
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                               f"{req.top_logprobs}", param="top_logprobs")
            if not req.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                           f"{req.logprobs}", param="logprobs")
        if req.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
        if req.best_of not in (None, req.n or 1):
            raise APIError(400, f"best_of must equal n (no ranking of extra candidates), got "
                           f"{req.best_of}", param="best_of")
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema" and (
            fmt.json_schema is None or fmt.json_schema.schema_ is None):
        raise APIError(400, "response_format json_schema needs json_schema.schema",
                       param="response_format.json_schema")


def logit_bias(req: ChatRequest | CompletionRequest, vocab: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs; ids must be in the vocabulary, bias in [-100, 100]."""
    out = []
    for key, bias in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys are token ids, got {key!r}",
                           param="logit_bias") from None
        if not 0 <= token < vocab:
            raise APIError(400, f"logit_bias token id {token} is outside the vocabulary "
                           f"[0, {vocab})", param="logit_bias")
        if not -100 <= bias <= 100:
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {bias!r}",
                           param="logit_bias")
        out.append((token, float(bias)))
    return tuple(out)


_PARAM_FIELDS = (*SCALAR_KNOBS, "seed", "speculative")


def sampling_params(req: ChatRequest | CompletionRequest, defaults: SamplingParams) -> SamplingParams:
    """The request's knobs over the server's defaults; a bad value is a 400 naming it."""
    values: dict[str, Any] = {f: getattr(req, f) for f in _PARAM_FIELDS if getattr(req, f) is not None}
    named = getattr(req, "max_completion_tokens", None)  # OpenAI's newer name wins
    max_tokens = named if named is not None else req.max_tokens
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    if req.stop is not None:
        values["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    if getattr(req, "echo", False) and getattr(req, "logprobs", None) is not None:
        values["prompt_logprobs"] = req.logprobs  # scoring: max_tokens may then be 0
    try:
        return msgspec.structs.replace(defaults, **values)
    except ValueError as exc:
        text = str(exc)
        param = text.split(" ", 1)[0]
        if param == "max_tokens" and named is not None:  # the name the client sent
            param, text = "max_completion_tokens", text.replace("max_tokens", "max_completion_tokens", 1)
        known = param in values or param in ("max_tokens", "max_completion_tokens", "stop")
        raise APIError(400, text, param=param if known else None) from None


class TokenizeRequest(_Req, kw_only=True):
    """vLLM's (`prompt` or `messages`) and llama.cpp's (`content`) forms."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None  # rendered with `messages`, as the chat request would be
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    with_pieces: bool = False  # llama.cpp: each token as {"id", "piece"}


class DetokenizeRequest(_Req, kw_only=True):
    model: str | None = None
    tokens: list[int]
