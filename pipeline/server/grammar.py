"""Constrained decoding: `response_format` and forced tool calls as llguidance token masks.

llguidance compiles a JSON schema (or a Lark grammar embedding JSON schemas) against the
container's own tokenizer.json, then says, token by token, which ids may come next; the
sampler (actors.sampler) sets the others to -inf before choosing. What comes out is
therefore valid by construction, whatever the weights: it parses and matches the schema
whenever the grammar finished (finish_reason "stop"); a generation cut by max_tokens is
cut, as everywhere.

JSON is generated without free whitespace: a model (a random one above all) may otherwise
spend its whole budget on newlines between tokens that the grammar allows.

Why llguidance: it reads a HF tokenizer.json directly (no transformers), handles the
special tokens Qwen writes tool calls with (`<tool_call>`), computes a mask over a 152k
vocabulary in tens of microseconds on the CPU, and needs no GPU kernel (its masks are
plain bitsets applied with one `mx.where`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from actors.sampler import TokenConstraint

_COMPACT = {"whitespace_flexible": False}
_MAX_ERROR_CHARS = 400


class GrammarError(ValueError):
    """The schema or tool definitions cannot be compiled into a grammar (a client error)."""


@functools.lru_cache(maxsize=4)
def ll_tokenizer(tokenizer_json: Path, stamp: int, vocab: int, eos: tuple[int, ...]) -> Any:
    """llguidance's view of the container's tokenizer (about a second to build: cached)."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab, eos_token=list(eos))


def tokenizer_for(root: Path, vocab: int, eos: Sequence[int]) -> Any:
    path = Path(root) / "tokenizer.json"
    return ll_tokenizer(path, path.stat().st_mtime_ns, vocab, tuple(sorted(eos)))


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    guidance = schema.get("x-guidance")
    return {**schema, "x-guidance": {**(guidance if isinstance(guidance, dict) else {}),
                                     **_COMPACT}}


def json_grammar(schema: dict[str, Any] | None) -> str:
    """Any JSON object (`json_object`), or one matching `schema` (`json_schema`)."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}, overrides=_COMPACT)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None


def tool_grammar(tools: Sequence[tuple[str, dict[str, Any] | None]], parallel: bool) -> str:
    """One or more Qwen tool calls, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    each naming one of `tools` ((name, parameters schema) pairs) with matching arguments.

    `<tool_call>` is a token of its own in Qwen's vocabulary, so the grammar names the
    token (what the model writes) rather than its characters.
    """
    import llguidance

    calls = [{"type": "object",
              "properties": {"name": {"const": name},
                             "arguments": params if params is not None else {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, params in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    repeat = ' ("\\n" call)*' if parallel else ""
    lark = (f"start: call{repeat}\n"
            f'call: <tool_call> "\\n" body "\\n" </tool_call>\n'
            f"body: %json {json.dumps(_compact(schema))}\n")
    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarConstraint(TokenConstraint):
    """One sequence's grammar state: the next-token mask, advanced by each sampled token.

    A matcher that errs (a token it had allowed, then refused: never expected) allows only
    the end-of-sequence tokens from then on, so the generation ends instead of wandering.
    """

    def __init__(self, tokenizer: Any, grammar: str, vocab: int, eos: Sequence[int]) -> None:
        import llguidance
        from llguidance.numpy import allocate_token_bitmask

        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error()[:_MAX_ERROR_CHARS])
        self.vocab = vocab
        self._bits = allocate_token_bitmask(1, vocab)
        self._eos_only = np.zeros(vocab, dtype=bool)
        self._eos_only[[t for t in eos if t < vocab]] = True

    def allowed(self) -> np.ndarray:
        from llguidance.numpy import fill_next_token_bitmask

        if self.matcher.is_error():
            return self._eos_only
        fill_next_token_bitmask(self.matcher, self._bits)
        mask = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")[: self.vocab]
        allowed = mask.astype(bool)
        return allowed if allowed.any() else self._eos_only

    def advance(self, token: int) -> None:
        if not self.matcher.is_error():
            self.matcher.consume_token(token)


def compile_constraint(tokenizer: Any, grammar: str, vocab: int,
                       eos: Sequence[int]) -> Callable[[], GrammarConstraint]:
    """Check `grammar` once (GrammarError if it does not compile, or if no output can even
    begin); returns a factory of fresh constraints, one per generated choice."""
    probe = GrammarConstraint(tokenizer, grammar, vocab, eos)
    probe.allowed()  # the first mask: where llguidance finds a grammar with no start
    if probe.matcher.is_error():
        # A schema whose `$ref`s only lead back to themselves describes no value at all:
        # its first mask errs (and allowed() would end the reply at once, an empty 200).
        raise GrammarError("the schema admits no value: nothing can be generated from its start "
                           "(a $ref that refers only to itself?)")
    return lambda: GrammarConstraint(tokenizer, grammar, vocab, eos)
