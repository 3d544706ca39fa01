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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from actors.sampler import TokenConstraint

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

_COMPACT: JsonCompileOptions = {"whitespace_flexible": False}
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


def compact_json(schema: dict[str, Any]) -> dict[str, Any]:
    guidance = schema.get("x-guidance")
    return {**schema, "x-guidance": {**(guidance if isinstance(guidance, dict) else {}),
                                     **_COMPACT}}


# Keys whose values are one subschema, or a list / a name -> subschema map of them.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems")
_MANY = ("anyOf", "oneOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords that say what a schema is without `type`: none is inferred beside them.
_UNTYPED = ("$ref", "anyOf", "oneOf", "allOf", "const", "enum", "not")


def closed(schema: Any, *, close: bool = True) -> Any:
    """`schema` with every object that lists `properties` but says nothing of
    `additionalProperties` closed to those properties, as llama.cpp's schema converter
    does. JSON Schema leaves such objects open, and a model under a grammar that allows
    another key may keep adding keys until max_tokens; a tool's declared parameters are
    the contract. An object with no `properties` (`{"type": "object"}`) stays any object.

    Members of an `allOf` are not closed themselves (each would forbid the others' keys),
    only what they contain. Like llama.cpp's converter, a schema without `type` that has
    `properties` is an object and one with `items` an array, and draft-4 tuple `items`
    (a list) mean `prefixItems`.
    """
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = dict(schema)
    if isinstance(out.get("items"), list):
        out["prefixItems"] = out.pop("items")
        if "additionalItems" in out:
            out["items"] = out.pop("additionalItems")
    if "type" not in out and not any(k in out for k in _UNTYPED):
        if "properties" in out:
            out["type"] = "object"
        elif "items" in out or "prefixItems" in out:
            out["type"] = "array"
    for key in _ONE:
        if isinstance(out.get(key), (dict, list)):
            out[key] = closed(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = closed(out[key])
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed(sub, close=False) for sub in out["allOf"]]
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed(out["additionalProperties"])
    if close and isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_grammar(schema: dict[str, Any] | None, *, strict: bool = False) -> str:
    """Any JSON object (`json_object`), or one matching `schema` (`json_schema`); objects
    the schema leaves open by omission are closed (`closed`) unless `strict`, where the
    schema is read as JSON Schema reads it."""
    import llguidance

    if schema is not None and not strict:
        schema = closed(schema)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}, overrides=_COMPACT)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None


def gbnf_grammar(text: str) -> str:
    """A llama.cpp GBNF grammar (or llguidance's Lark form) as an llguidance grammar."""
    import llguidance

    try:
        return llguidance.grammar_from("gbnf", text)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid grammar: {str(exc)[:_MAX_ERROR_CHARS]}") from None


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
