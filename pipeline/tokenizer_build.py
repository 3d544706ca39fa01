"""tokenizer.json into one Rust `tokenizers` object, its big tables handed over from Python.

`Tokenizer.from_file` parses the whole file in Rust: serde buffers the model section as a
tree of small strings (every vocabulary entry, both halves of every merge) between the
allocations the object keeps. Freed, that garbage leaves the kept ones scattered over
pages that stay resident: at Qwen3.5's 248k tokens and 500k merges the object holds
66 MiB of live heap in 89 MiB of RSS (2026-12-03, docs/memory.md). Here Python parses
the JSON (its small objects live in Python's own arenas, unmapped once empty), the BPE
model is built from the vocabulary and merges passed as Python objects, and the rest of
the file (normalizer, pre-tokenizer, decoder, post-processor, settings) is parsed by
the library from the file with the model's tables emptied; the added tokens are added
after the model, in id order, and must get the file's ids. The object is the one
`from_file` gives (tests/test_tokenizer.py compares them); at 248k tokens it costs
69 MiB of RSS. Any other model type, or a file this path does not read exactly as the
library would, goes through `from_file`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("moestream.tokenizer")

# BPE's settings in tokenizer.json, as `tokenizers.models.BPE` takes them.
BPE_SETTINGS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                "fuse_unk", "byte_fallback", "ignore_merges")


# An added token's fields in tokenizer.json, every one of which the library requires.
ADDED_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")
ADDED_FIELDS = frozenset({"id", "content", *ADDED_FLAGS})


def _merge_pairs(merges: list[Any]) -> list[tuple[str, str]] | None:
    """The merges as pairs: tokenizers writes `[a, b]` (or "a b" in older files, which it
    splits on its one space); None where the library would read them otherwise."""
    pairs: list[tuple[str, str]] = []
    if len({type(m) for m in merges}) > 1:  # the library refuses a mix of the two forms
        return None
    for merge in merges:
        if isinstance(merge, str):
            if merge.startswith("#version"):  # the library skips such lines, wherever they are
                continue
            parts = merge.split(" ")
        elif isinstance(merge, list):
            parts = merge
        else:
            return None
        if len(parts) != 2 or not all(isinstance(p, str) for p in parts):
            return None
        pairs.append((parts[0], parts[1]))
    return pairs


def _build(text: str) -> Any:
    """The tokenizer built from the JSON text, or None when this path does not apply."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import BPE

    data = json.loads(text)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return None
    vocab, merges = model.get("vocab"), model.get("merges")
    added = data.get("added_tokens") or []
    if not isinstance(vocab, dict) or not isinstance(merges, list) or not isinstance(added, list):
        return None
    pairs = _merge_pairs(merges)
    if pairs is None or set(model) - {"type", "vocab", "merges", *BPE_SETTINGS}:
        return None
    del merges
    # Everything but the model's tables and the added tokens, parsed by the library.
    model["vocab"], model["merges"], data["added_tokens"] = {}, [], []
    shell = Tokenizer.from_str(json.dumps(data))
    del data
    # An unset one (null) is the constructor's default, which takes no None for strings.
    settings = {k: model[k] for k in BPE_SETTINGS if model.get(k) is not None}
    shell.model = BPE(vocab=vocab, merges=pairs, **settings)
    del vocab, pairs
    # Added in the file's order, as the library does (it numbers them so, whatever ids the
    # file gives); the file's ids must come out, and every field be there as it requires.
    if not all(isinstance(e, dict) and ADDED_FIELDS <= set(e) and type(e["id"]) is int
               and all(type(e[f]) is bool for f in ADDED_FLAGS) for e in added):
        return None
    shell.add_tokens([AddedToken(e["content"], single_word=e["single_word"], lstrip=e["lstrip"],
                                 rstrip=e["rstrip"], normalized=e["normalized"], special=e["special"])
                      for e in added])
    if any(shell.token_to_id(e["content"]) != e["id"] for e in added):
        return None
    return shell


def parse(path: Path) -> Any:
    """The `tokenizers.Tokenizer` of tokenizer.json at `path`."""
    from tokenizers import Tokenizer

    text = Path(path).read_text(encoding="utf-8")
    try:
        built = _build(text)
    except Exception as exc:  # noqa: BLE001 - the library's own parse below says what is wrong
        log.debug("tokenizer.build_fallback", path=str(path), error=str(exc))
        built = None
    return built if built is not None else Tokenizer.from_str(text)
