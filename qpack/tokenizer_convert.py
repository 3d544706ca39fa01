"""A release's tokenizer in another format turned into the tokenizer.json the engine loads.

Kimi-K2 (moonshotai/Kimi-K2-Instruct) ships `tiktoken.model` (one `base64(bytes) rank` line
per token), tokenizer_config.json (whose `added_tokens_decoder` names the special ids) and
remote code (`tokenization_kimi.py`), but no tokenizer.json. A tiktoken rank table is a
byte-level BPE whose merge priority is the merged token's rank, so its `tokenizers`
equivalent is: vocab = the ranks' bytes mapped through GPT-2's byte-to-unicode table, and for
every token every split into two tokens that exist, ordered by the merged token's rank (what
transformers' TikTokenConverter writes). Every split, not only the lowest-ranked one: tiktoken
merges whichever adjacent pair forms the lowest-ranked token, so a token reachable by two
splits must be reachable by both here, or some texts encode differently. `CONVERSIONS`
maps a source file name to its converter: another format is one more entry.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import structlog

from qpack.families.kimi_chat import PAT as KIMI_PATTERN
from qpack.spec import QpackError, parse_json

log = structlog.get_logger("qpack.tokenizer_convert")

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# What tokenization_kimi.py calls a special id tokenizer_config does not name.
RESERVED = "<|reserved_token_{}|>"
# The class transformers loads a plain tokenizer.json with; the release's own
# (TikTokenTokenizer, remote code via auto_map) would need files the container lacks.
FAST_CLASS = "PreTrainedTokenizerFast"


@cache
def byte_to_unicode() -> tuple[str, ...]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return tuple(table[b] for b in range(256))


def bpe_model(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The tokenizers-library vocab and merges equivalent to a tiktoken rank table."""
    table = dict(enumerate(byte_to_unicode()))
    text = {tok: tok.decode("latin-1").translate(table) for tok in ranks}
    merges: list[tuple[int, int, int, str, str]] = []
    get = ranks.get
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            lr = get(left)
            if lr is not None:
                rr = get(right)
                if rr is not None:
                    merges.append((rank, lr, rr, text[left], text[right]))
    merges.sort()
    return {text[tok]: rank for tok, rank in ranks.items()}, [(m[3], m[4]) for m in merges]


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken rank file's table; a damaged line is a QpackError naming file and line."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise QpackError(path, f"cannot read: {exc.strerror}") from None
    ranks: dict[bytes, int] = {}
    seen: dict[int, int] = {}  # rank -> the line that gave it
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue  # tiktoken's loader skips blank lines too
        fields = line.split()
        if len(fields) != 2:
            raise QpackError(path, f"line {n}: expected 'base64 rank', got {len(fields)} fields")
        try:
            tok = base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError):
            raise QpackError(path, f"line {n}: token is not valid base64") from None
        try:
            rank = int(fields[1])
        except ValueError:
            shown = fields[1][:20].decode("utf-8", "replace")
            raise QpackError(path, f"line {n}: rank {shown!r} is not an integer") from None
        if rank < 0:
            raise QpackError(path, f"line {n}: rank {rank} is negative")
        if rank in seen:
            raise QpackError(path, f"line {n}: rank {rank} repeats line {seen[rank]}")
        if tok in ranks:
            raise QpackError(path, f"line {n}: token repeats the one of rank {ranks[tok]}")
        seen[rank] = n
        ranks[tok] = rank
    if not ranks:
        raise QpackError(path, "holds no ranks")
    # Ranks are the token ids: a gap would shift every id after it.
    if len(ranks) != max(seen) + 1:
        missing = next(r for r in range(len(ranks) + 1) if r not in seen)
        raise QpackError(path, f"ranks are not 0..{len(ranks) - 1}: rank {missing} is missing")
    if absent := [b for b in range(256) if bytes([b]) not in ranks]:
        # A byte-level BPE needs every byte: a text holding an absent one cannot encode.
        raise QpackError(path, f"byte {absent[0]:#04x} has no rank ({len(absent)} of the 256 bytes lack one)")
    return ranks


@dataclass(frozen=True)
class Special:
    content: str
    special: bool = True


def named_specials(config: dict[str, Any], path: Path) -> dict[int, Special]:
    """tokenizer_config.json's `added_tokens_decoder`: id -> token."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise QpackError(path, "added_tokens_decoder is not a JSON object")
    named: dict[int, Special] = {}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not str(key).isdigit() or not isinstance(content, str):
            raise QpackError(path, f"added_tokens_decoder entry {str(key)[:20]!r}: expected an id "
                             "and an object with a 'content' string")
        named[int(key)] = Special(content, bool(entry.get("special", True)))
    return named


def all_specials(named: dict[int, Special], first: int, vocab_size: int | None) -> dict[int, Special]:
    """Every added id: the named ones and `<|reserved_token_ID|>` for the unnamed ids from the
    first past the ranks up to config.json's vocab_size (as tokenization_kimi names them).
    Never past vocab_size: the embedding has no row there (Kimi-K2's tokenizer_config also
    names 163840 and 163841, past its 163840 rows), so such ids are left out."""
    end = vocab_size if vocab_size is not None else max(named, default=first - 1) + 1
    if clash := [i for i in named if i < first]:
        raise ValueError(f"added_tokens_decoder names id {clash[0]}, which is a BPE rank (ranks end at {first - 1})")
    if dropped := sorted(i for i in named if i >= end):
        log.info("tokenizer.specials_past_vocab", ids=dropped, vocab_size=end)
    return {i: named.get(i) or Special(RESERVED.format(i)) for i in range(first, end)}


def build_tokenizer(ranks: dict[bytes, int], pattern: str, specials: dict[int, Special]) -> Any:
    """The `tokenizers.Tokenizer` that encodes as tiktoken does with these ranks and pattern
    (and `allowed_special="all"`). No normalizer: tiktoken applies none."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab, merges = bpe_model(ranks)
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                        byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # Added tokens take the next free ids in order: `specials` is contiguous from the last
    # rank + 1, so each gets its own id (checked below all the same).
    ordered = sorted(specials.items())
    tok.add_tokens([AddedToken(s.content, special=s.special, normalized=False) for _, s in ordered])
    if wrong := [(i, s.content) for i, s in ordered if tok.token_to_id(s.content) != i]:
        raise ValueError(f"special token {wrong[0][1]!r} did not get id {wrong[0][0]} (a repeated name?)")
    return tok


def decoder_entries(specials: dict[int, Special]) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json's `added_tokens_decoder` for these specials."""
    return {str(i): {"content": s.content, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": s.special} for i, s in sorted(specials.items())}


def _read_config(root: Path) -> tuple[dict[str, Any], Path]:
    path = root / TOKENIZER_CONFIG
    if not path.is_file():
        raise QpackError(root, f"has tiktoken.model but no {TOKENIZER_CONFIG} (which names its special tokens)")
    config = parse_json(path.read_bytes(), path, TOKENIZER_CONFIG)
    if not isinstance(config, dict):
        raise QpackError(path, "is not a JSON object")
    return config, path


def convert_tiktoken(root: Path, vocab_size: int | None) -> dict[str, bytes]:
    """tiktoken.model + tokenizer_config.json -> tokenizer.json and a tokenizer_config.json
    for it. The split pattern is Kimi-K2's (tokenization_kimi.py's pat_str): the rank file
    does not carry one, and Kimi-K2 is the one release packed that ships this format."""
    path = root / "tiktoken.model"
    ranks = read_ranks(path)
    if vocab_size is not None and vocab_size < len(ranks):
        # Ids past the embedding's rows would index outside it.
        raise QpackError(path, f"has {len(ranks)} ranks, more than config.json's vocab_size {vocab_size}")
    config, config_path = _read_config(root)
    try:
        specials = all_specials(named_specials(config, config_path), len(ranks), vocab_size)
        tok = build_tokenizer(ranks, KIMI_PATTERN, specials)
    except ValueError as exc:
        raise QpackError(config_path, str(exc)) from None
    config = {k: v for k, v in config.items() if k != "auto_map"}  # remote code left behind
    config["tokenizer_class"] = FAST_CLASS
    config["added_tokens_decoder"] = decoder_entries(specials)
    log.info("tokenizer.converted", source=str(path), ranks=len(ranks), specials=len(specials))
    return {TOKENIZER_JSON: tok.to_str().encode(),
            TOKENIZER_CONFIG: (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()}


# Source file name -> converter (checkpoint directory, config.json's vocab_size) -> the files
# it writes (name -> bytes), which replace the source's own of those names.
CONVERSIONS: dict[str, Callable[[Path, int | None], dict[str, bytes]]] = {
    "tiktoken.model": convert_tiktoken,
}


def conversion_source(names: Iterable[str]) -> str | None:
    """The file a checkpoint's tokenizer.json is converted from, None where it has one (or
    nothing to convert from)."""
    present = set(names)
    if TOKENIZER_JSON in present:
        return None
    return next((name for name in CONVERSIONS if name in present), None)


def tokenizer_outputs(root: Path, files: list[Path], vocab_size: int | None) -> dict[str, bytes]:
    """The tokenizer files a container gets from checkpoint `root`: `files` as they are, plus
    a converted tokenizer.json (and config) where the checkpoint has none."""
    out = {f.name: f.read_bytes() for f in files}
    source = conversion_source(p.name for p in root.iterdir() if p.is_file())
    if source is not None:
        out.update(CONVERSIONS[source](root, vocab_size))
    return out
