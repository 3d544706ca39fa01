"""The OpenAI wire format: request and response structs, decoding with errors that name the field.

Requests are decoded strictly (msgspec, `forbid_unknown_fields`): a typo such as
`temprature` is a 400 naming the field rather than a silently ignored knob. Fields
that clients commonly send but this server has no use for are accepted and checked
for values it can honour (`n` 1, `logprobs` false, ...). `APIError` carries the
OpenAI error body `{"error": {"message", "type", "param", "code"}}` and its status.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from actors.sampling_params import SamplingParams


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


# --- requests ----------------------------------------------------------------------------


class _Req(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
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


class _Sampling(_Req, kw_only=True):
    model: str
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
    response_format: dict[str, Any] | None = None
    # Template variables, e.g. {"enable_thinking": false} (vLLM's and SGLang's field).
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[str | int]  # one string, a list of one string, or token ids
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
        text = str(exc)
        match = _PATH.search(text)
        param = match.group("path") if match else None
        missing = re.match(r"Object missing required field `(\w+)`", text)
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        unknown = re.match(r"Object contains unknown field `(\w+)`", text)
        if unknown:
            param = f"{param}.{unknown.group(1)}" if param else unknown.group(1)
            text = f"unrecognized request argument supplied: {param}"
        raise APIError(400, f"invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


def check_unsupported(req: ChatRequest | CompletionRequest) -> None:
    """Options the API defines that this server cannot honour: refuse rather than ignore."""
    if req.n is not None and req.n != 1:
        raise APIError(400, f"n must be 1 (one choice per request), got {req.n}", param="n")
    if isinstance(req, ChatRequest):
        if req.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if req.top_logprobs:
            raise APIError(400, "top_logprobs are not supported", param="top_logprobs")
        fmt = (req.response_format or {}).get("type", "text")
        if fmt != "text":
            raise APIError(400, f"response_format {fmt!r} is not supported (only 'text')",
                           param="response_format")
    else:
        if req.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise APIError(400, f"best_of must be 1, got {req.best_of}", param="best_of")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")


_PARAM_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seed")


def sampling_params(req: ChatRequest | CompletionRequest, defaults: SamplingParams) -> SamplingParams:
    """The request's knobs over the server's defaults; a bad value is a 400 naming it."""
    values: dict[str, Any] = {f: getattr(req, f) for f in _PARAM_FIELDS if getattr(req, f) is not None}
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    if req.stop is not None:
        values["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    try:
        return msgspec.structs.replace(defaults, **values)
    except ValueError as exc:
        text = str(exc)
        param = text.split(" ", 1)[0]
        if param == "max_tokens" and getattr(req, "max_completion_tokens", None):
            param = "max_completion_tokens"
        known = param in values or param in ("max_tokens", "max_completion_tokens", "stop")
        raise APIError(400, text, param=param if known else None) from None


# --- responses ---------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class OutFunction(msgspec.Struct):
    name: str
    arguments: str


class OutToolCall(msgspec.Struct):
    id: str
    function: OutFunction
    type: str = "function"


class OutMessage(msgspec.Struct, omit_defaults=True, kw_only=True):
    role: str  # no default: omit_defaults would drop it
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[OutToolCall] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: OutMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: OutFunction | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class TextChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "moestream"
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
