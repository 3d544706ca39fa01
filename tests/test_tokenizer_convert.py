"""A tiktoken release's tokenizer (Kimi-K2's tiktoken.model + tokenizer_config.json) converted
to tokenizer.json at pack time (qpack/tokenizer_convert.py): the same ids as tiktoken itself,
damaged rank files refused in one line, and synth's tiktoken format packed and generated from.

The rank file is the synthetic Kimi one (Qwen3.6's ranks cut to Kimi's 163584, Kimi's split
pattern and special ids): the real release's file is not reachable here."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
import tiktoken

from pipeline.cli import main
from pipeline.tokenizer import Tokenizer
from qpack.hub import wanted_files
from qpack.spec import QpackError
from qpack.synth.tokenizer_files import write_tiktoken
from qpack.tokenizer_convert import KIMI_PATTERN, convert_tiktoken, read_ranks

VOCAB = 163840  # Kimi-K2's config.json vocab_size: 163584 ranks + 256 specials
CORPUS = [
    "Hello, world! It's a test; we'll see what's DONE.",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\tif x != 0:\n\t\tpass\r\n",
    "中文分词测试，汉字和English混排abc中文",
    "日本語のテキストとカタカナ、한국어 문장",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "   leading and    runs of spaces   \n\n\n  trailing   ",
    "12345678901 3.14159 1,000,000 ٣٤٥ ¹²³",
    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "[BOS]x[EOS]<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
    "<|tool_call_argument_begin|>{\"a\": 1}<|tool_call_end|><|tool_calls_section_end|>",
    "<|reserved_token_163600|> and [UNK] [PAD]",
    "Ünïcödé e\u0301 (not NFC) Ωmega ß ﬁ",
    "",
]


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer files as Kimi-K2's release ships them (no tokenizer.json)."""
    out = tmp_path_factory.mktemp("kimi-release")
    write_tiktoken(out, "deepseek_v3", "kimi-k2")
    return out


@pytest.fixture(scope="module")
def converted_files(release: Path) -> dict[str, bytes]:
    return convert_tiktoken(release, VOCAB)


@pytest.fixture(scope="module")
def converted(converted_files: dict[str, bytes], tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("kimi-converted")
    for name, data in converted_files.items():
        (out / name).write_bytes(data)
    return Tokenizer(out)


@pytest.fixture(scope="module")
def reference(release: Path) -> tiktoken.Encoding:
    """tiktoken itself, set up as tokenization_kimi.py sets it up."""
    ranks = read_ranks(release / "tiktoken.model")
    config = json.loads((release / "tokenizer_config.json").read_text())
    named = {int(i): e["content"] for i, e in config["added_tokens_decoder"].items()}
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), len(ranks) + 256)}
    return tiktoken.Encoding("kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def test_ids_equal_tiktoken_and_decode_back(converted: Tokenizer, reference: tiktoken.Encoding) -> None:
    for text in CORPUS:
        want = reference.encode(text, allowed_special="all")
        got = converted.encode(text, add_special_tokens=False)
        assert got == want, text
        assert converted.decode(got) == text
    assert converted.vocab_size == VOCAB
    # The specials at Kimi's ids: named ones, the reserved ones filled in, the last one.
    ids = converted.encode("[BOS]<|im_end|><|reserved_token_163589|>[PAD]", add_special_tokens=False)
    assert ids == [163584, 163586, 163589, 163839]
    assert converted.eos_token_id == 163585


def test_config_for_the_engine(converted_files: dict[str, bytes]) -> None:
    config = json.loads(converted_files["tokenizer_config.json"])
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "auto_map" not in config
    decoder = config["added_tokens_decoder"]
    assert len(decoder) == 256 and decoder["163600"]["content"] == "<|reserved_token_163600|>"
    assert decoder["163601"]["content"] == "<|im_middle|>"


def test_specials_past_vocab_size_are_left_out(release: Path, tmp_path: Path) -> None:
    """The released config names 163840 and 163841, past the embedding's rows: left out.
    (The release's first 300 ranks: a smaller BPE, still a valid one.)"""
    lines = (release / "tiktoken.model").read_bytes().splitlines()[:300]
    (tmp_path / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")
    named = {"301": {"content": "<|named|>", "special": False}, "304": {"content": "<|past|>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": named}))
    tok = json.loads(convert_tiktoken(tmp_path, 304)["tokenizer.json"])
    added = {t["id"]: (t["content"], t["special"]) for t in tok["added_tokens"]}
    assert added == {300: ("<|reserved_token_300|>", True), 301: ("<|named|>", False),
                     302: ("<|reserved_token_302|>", True), 303: ("<|reserved_token_303|>", True)}
    with pytest.raises(QpackError, match="has 300 ranks, more than config.json's vocab_size 299"):
        convert_tiktoken(tmp_path, 299)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"7": {"content": "x"}}}))
    with pytest.raises(QpackError, match="names id 7, which is a BPE rank"):
        convert_tiktoken(tmp_path, 304)


def _one_line(exc: QpackError) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


@pytest.mark.parametrize(("line", "why"), [
    (b"!!!notbase64 5", "line 3: token is not valid base64"),
    (base64.b64encode(b"zz-new") + b" five", "line 3: rank 'five' is not an integer"),
    (base64.b64encode(b"zz-new") + b" 0", "line 3: rank 0 repeats line 1"),
    (base64.b64encode(b"zz-new"), "line 3: expected 'base64 rank', got 1 fields"),
])
def test_damaged_rank_file_is_one_line_naming_file_and_line(release: Path, tmp_path: Path,
                                                            line: bytes, why: str) -> None:
    lines = (release / "tiktoken.model").read_bytes().splitlines()
    path = tmp_path / "tiktoken.model"
    path.write_bytes(b"\n".join([*lines[:2], line, *lines[2:]]) + b"\n")
    with pytest.raises(QpackError) as info:
        read_ranks(path)
    assert _one_line(info.value) == f"{path}: {why}"


def test_rank_gaps_and_missing_bytes_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "tiktoken.model"
    path.write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(255)))
    with pytest.raises(QpackError, match="byte 0xff has no rank"):
        read_ranks(path)
    path.write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % (b + (b > 9)) for b in range(256)))
    with pytest.raises(QpackError, match="rank 10 is missing"):
        read_ranks(path)


def test_hub_fetches_the_rank_file_only_where_no_tokenizer_json() -> None:
    kimi = ["config.json", "tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py",
            "model-00001-of-00002.safetensors", "README.md"]
    assert wanted_files(kimi) == ["config.json", "model-00001-of-00002.safetensors",
                                  "tiktoken.model", "tokenizer_config.json"]
    assert "tiktoken.model" not in wanted_files([*kimi, "tokenizer.json"])


@pytest.fixture(scope="module")
def synth_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`moestream synth --tokenizer-format tiktoken` of the kimi-tiny preset (1 dense + 1 MoE
    layer). Read-only: a test that damages it damages a copy."""
    src = tmp_path_factory.mktemp("kimi-synth") / "kimi"
    assert main(["synth", "--family", "deepseek_v3", "--preset", "kimi-tiny", "--tokenizer-format", "tiktoken",
                 "--max-layers", "2", "--dtype", "float32", "-o", str(src), "--no-progress"]) == 0
    return src


def test_synth_tiktoken_packs_and_generates(synth_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            reference: tiktoken.Encoding) -> None:
    src, out = synth_src, tmp_path / "kimi.qpack"
    assert (src / "tiktoken.model").is_file() and not (src / "tokenizer.json").exists()
    assert main(["pack", str(src), "-o", str(out), "--bits", "4", "--no-progress"]) == 0
    assert not (out / "tiktoken.model").exists()
    prompt = "<|im_user|>user<|im_middle|>你好 hello<|im_end|><|im_assistant|>assistant<|im_middle|>"
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", prompt, "--slots", "16", "--prefill-chunk", "2",
                 "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out  # the generated text (random weights: meaningless)
    tok = Tokenizer(out)
    assert tok.encode(prompt, add_special_tokens=False) == reference.encode(prompt, allowed_special="all")
    assert tok.eos_token_ids == {163585, 163586}


def test_damaged_rank_file_fails_pack_in_one_line(synth_src: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "kimi"
    shutil.copytree(synth_src, src)
    rank_file = src / "tiktoken.model"
    lines = rank_file.read_bytes().splitlines()
    lines[6] = lines[6].split()[0] + b" 6x"
    rank_file.write_bytes(b"\n".join(lines) + b"\n")
    capsys.readouterr()
    assert main(["pack", str(src), "-o", str(tmp_path / "k.qpack"), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: {rank_file}: line 7: rank '6x' is not an integer"], err[-2000:]
    assert "Traceback" not in err
    # Refused before any weight was written.
    assert not list((tmp_path / "k.qpack").glob("*.safetensors"))


def test_tiktoken_format_is_refused_for_other_tokenizers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="only Kimi-K2's tokenizer ships as tiktoken.model"):
        write_tiktoken(tmp_path, "qwen3_next")
    out = tmp_path / "q"
    assert main(["synth", "--family", "qwen3_next", "--preset", "tiny", "--tokenizer-format", "tiktoken",
                 "-o", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "only Kimi-K2's tokenizer ships as tiktoken.model" in err[0], err
    assert not out.exists() or not any(out.iterdir())  # refused before any shard
