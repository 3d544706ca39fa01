"""The container's tokenizer: one Rust `tokenizers` object and a few ids, nothing more.

mlx-lm's wrapper over transformers' fast tokenizer cost 430 MiB resident for Qwen3.5's
248k vocabulary (measured, docs/memory.md): transformers itself, Python copies of the
vocabulary (`get_vocab`, the added-token maps) and a detokenizer token map of every
piece. Here the vocabulary lives only in the Rust object; decode-side lookups ask it
one id at a time, the streaming detokenizer is the library's `DecodeStream`, and the
chat template renders through `pipeline.template_render`. Loading parses tokenizer.json
(`pipeline.tokenizer_build`: 69 MiB kept at 248k tokens, a transient of ~270 MiB more freed
right after, handed back to the OS with malloc_trim), so the engine loads it before the
dense core: the transient never meets the peak.

The surface is what the engine, the server and the tests use of mlx-lm's wrapper:
encode, decode, apply_chat_template, eos_token_id(s), convert_ids_to_tokens,
detokenizer, chat_template, vocab_size.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.generation_config import eos_token_ids
from pipeline.template_render import render

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def _token_text(value: Any) -> str | None:
    """tokenizer_config's token entries are a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


def _chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja (Qwen3.5/3.6 ship it on its own) over tokenizer_config's."""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    value = config.get("chat_template")
    if isinstance(value, list):  # named templates: the default one
        value = next((t.get("template") for t in value if t.get("name") == "default"), None)
    return value if isinstance(value, str) else None


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc); a no-op elsewhere."""
    from pipeline.heap_trim import malloc_trim

    trim = malloc_trim()
    if trim is not None:
        trim(0)


class StreamDetokenizer:
    """Text as tokens arrive, whole UTF-8 characters only, every space kept.

    `DecodeStream` returns a token's text once its bytes complete a character (a
    multi-byte character may span tokens); `finalize` flushes what is left with
    replacement characters, as mlx-lm's detokenizers do.
    """

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)
        self._pending: list[int] = []  # ids whose text is not out yet
        self._segment = ""
        self.text = ""
        self.tokens: list[int] = []

    def reset(self) -> None:
        self.__init__(self._tok)  # type: ignore[misc]

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self._pending.append(token)
        try:
            piece = self._stream.step(self._tok, token)
        except Exception:  # noqa: BLE001 - the library's stream gave up, not the generation
            # A byte-fallback tokenizer's stray byte can re-decode text already sent (the
            # library then raises "Invalid prefix"): the ids not out yet go out as they
            # decode, and the stream starts again after them.
            from tokenizers.decoders import DecodeStream  # here: not on every token's path

            piece = self._tok.decode(self._pending, skip_special_tokens=False)
            self._stream = DecodeStream(skip_special_tokens=False)
        if piece:
            self._pending.clear()
            self._emit(piece)

    def finalize(self) -> None:
        if self._pending:
            self._emit(self._tok.decode(self._pending, skip_special_tokens=False))
            self._pending.clear()

    def _emit(self, piece: str) -> None:
        self.text += piece
        self._segment += piece

    @property
    def last_segment(self) -> str:
        """The text since the last call."""
        out, self._segment = self._segment, ""
        return out


class Tokenizer:
    def __init__(self, root: Path) -> None:
        from pipeline import tokenizer_build

        root = Path(root)
        self._tok = tokenizer_build.parse(root / "tokenizer.json")
        trim_heap()  # the JSON parse's garbage: ~270 MiB at 248k tokens
        config = _read_json(root / "tokenizer_config.json")
        self.chat_template = _chat_template(root, config)
        self.special_tokens = {name: text for name in SPECIAL_TOKEN_NAMES
                               if (text := _token_text(config.get(name))) is not None}
        # tokenizer_config's flags win over tokenizer.json's (the Qwen files mark <think>
        # and <tool_call> special in one and not in the other; transformers reads the config).
        decoder = config.get("added_tokens_decoder") or {}
        if decoder:
            flags = {int(i): bool(t.get("special", True)) for i, t in decoder.items()}
        else:
            flags = {i: a.special for i, a in self._tok.get_added_tokens_decoder().items()}
        self._special_ids = frozenset(i for i, special in flags.items() if special)
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id: int | None = self._tok.token_to_id(eos) if eos else None
        ids = set(eos_token_ids(root) or [])
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        self.eos_token_ids = frozenset(ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._tok.decode(ids, skip_special_tokens=False)

    def convert_ids_to_tokens(self, token: int) -> str | None:
        return self._tok.id_to_token(token)

    @property
    def detokenizer(self) -> StreamDetokenizer:
        """A fresh streaming detokenizer (one per generation)."""
        return StreamDetokenizer(self._tok)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], /, *,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            **variables: Any) -> str | list[int]:
        if self.chat_template is None:
            raise ValueError("the container's tokenizer has no chat template "
                             "(chat_template.jinja or tokenizer_config.json's chat_template)")
        text = render(self.chat_template, messages, tools=tools,
                      add_generation_prompt=add_generation_prompt,
                      **{**self.special_tokens, **variables})
        return self.encode(text) if tokenize else text


def tokenizer_files_stamp(root: Path) -> int:
    path = Path(root) / "tokenizer.json"
    return path.stat().st_mtime_ns if path.exists() else 0


def load_tokenizer(root: Path) -> Tokenizer:
    """The container's tokenizer, built once per process and file version (engines
    reopened in one process share it; a generation takes its own detokenizer)."""
    return _load(str(Path(root).resolve()), tokenizer_files_stamp(root))


# Eight: a test worker or a benchmark opens a handful of containers.
@functools.lru_cache(maxsize=8)
def _load(root: str, stamp: int) -> Tokenizer:
    return Tokenizer(Path(root))
