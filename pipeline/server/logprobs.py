"""Sampled tokens' log-probabilities in OpenAI's two wire forms (chat and legacy completions).

Token text is the token's own bytes (byte-level BPE: one token may hold half a character),
given as text with `bytes` beside it, as OpenAI does.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from actors.token_logprob import TokenLogprob


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    # GPT-2's byte-level alphabet, inverted: the characters token strings are written in.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class TokenTexts:
    """Token id -> (text, bytes), cached; the tokenizer's own pieces, not a decode of each id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            piece = self.tokenizer.convert_ids_to_tokens(token) or ""
            table = _unicode_to_byte()
            if all(ch in table for ch in piece):
                raw = bytes(table[ch] for ch in piece)
            else:  # an added token (<|im_end|>, <tool_call>): its text is its bytes
                raw = piece.encode()
            hit = (raw.decode("utf-8", errors="replace"), list(raw))
            self._cache[token] = hit
        return hit


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]
    refusal: None = None


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> ChatLogprobs:
    out = []
    for e in entries:
        text, raw = texts(e.token)
        top = [TopLogprob(*texts(t)[:1], lp, texts(t)[1]) for t, lp in e.top]
        out.append(ChatTokenLogprob(text, e.logprob, raw, top))
    return ChatLogprobs(out)


class TextLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def text_logprobs(entries: list[TokenLogprob | int], texts: TokenTexts,
                  start_offset: int = 0) -> TextLogprobs:
    """Legacy completions form; a bare token id (an echoed prompt token) has no logprob."""
    out = TextLogprobs([], [], [], [])
    offset = start_offset
    for e in entries:
        token = e if isinstance(e, int) else e.token
        text = texts(token)[0]
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if isinstance(e, int):
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(e.logprob)
            out.top_logprobs.append({texts(t)[0]: lp for t, lp in e.top})
    return out
