"""The OpenAI wire format, replies: completion bodies, stream chunks, usage, model cards.

All plain msgspec structs, encoded as they are; requests and errors are schema.py's.
"""

from __future__ import annotations

import msgspec

from pipeline.server.logprobs import ChatLogprobs, TextLogprobs


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
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    system_fingerprint: str  # pipeline.fingerprint: container and code versions
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
    logprobs: ChatLogprobs | None = None


class ChatChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    system_fingerprint: str  # pipeline.fingerprint: container and code versions
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class TextChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: TextLogprobs | None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    system_fingerprint: str  # pipeline.fingerprint: container and code versions
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


class TokenPiece(msgspec.Struct):
    """llama.cpp's `with_pieces` form: the token's text, or its bytes when they are not
    whole UTF-8 characters."""

    id: int
    piece: str | list[int]


class TokenizeResponse(msgspec.Struct):
    tokens: list[int] | list[TokenPiece]
    count: int
    max_model_len: int


class DetokenizeResponse(msgspec.Struct):
    prompt: str
    content: str  # llama.cpp's name for the same text
