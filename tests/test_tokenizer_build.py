"""tokenizer.json built with its tables handed over from Python (pipeline/tokenizer_build.py):
the object the library's own parse gives, or the library's parse itself where that path
does not apply. Real files: the synth's 248k-token Qwen3.5 tokenizer, and small ones
written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pipeline import tokenizer_build
from qpack.synth.tokenizer import tokenizer_json

TEXTS = ["Hello world! naïve café", "<|im_start|>user\nhi<|im_end|>\n", "日本語 🤖 3.14159\r\n"]


def _same(built: Tokenizer, path: Path) -> None:
    library = Tokenizer.from_file(str(path))
    assert built.to_str() == library.to_str()
    for text in TEXTS:
        assert built.encode(text).ids == library.encode(text).ids


def _first_ranks(text: str, kept: int) -> str:
    """The Qwen3.5 tokenizer.json cut to its first `kept` ranks (and the merges among them),
    its added tokens renumbered after them: the real file's structure at a twelfth of its
    size (the whole one is pinned by its memory, tests/test_memory.py)."""
    data = json.loads(text)
    model = data["model"]
    model["vocab"] = {t: i for t, i in model["vocab"].items() if i < kept}
    model["merges"] = [m for m in model["merges"]
                       if m[0] in model["vocab"] and m[1] in model["vocab"] and m[0] + m[1] in model["vocab"]]
    for i, entry in enumerate(sorted(data["added_tokens"], key=lambda e: e["id"])):
        entry["id"] = kept + i
    return json.dumps(data, ensure_ascii=False)


def test_the_qwen_tokenizer_builds_the_object_the_library_parses(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(_first_ranks(tokenizer_json("qwen3_5_moe"), 20_000), encoding="utf-8")
    built = tokenizer_build._build(path.read_text(encoding="utf-8"))
    assert built is not None  # the Python-fed path, not the fallback
    _same(built, path)


def _small(tmp_path: Path, **changes: object) -> Path:
    """A small byte-level BPE tokenizer.json written by the library, with `changes`."""
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(vocab={"a": 0, "b": 1, "ab": 2, "c": 3}, merges=[("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder()
    tok.add_tokens([AddedToken("<eos>", special=True, normalized=False)])
    data = json.loads(tok.to_str())
    data.update(changes)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    return path


def test_a_small_bpe_file_with_old_style_merges_builds_the_same(tmp_path: Path) -> None:
    path = _small(tmp_path)
    data = json.loads(path.read_text())
    data["model"]["merges"] = ["a b"]  # "a b", as older tokenizers wrote them
    path.write_text(json.dumps(data))
    built = tokenizer_build._build(path.read_text())
    assert built is not None
    _same(built, path)


def _two_added(tmp_path: Path) -> Path:
    """`_small` with a second added token, listed before the first (ids 5, 4)."""
    path = _small(tmp_path)
    data = json.loads(path.read_text())
    second = {**data["added_tokens"][0], "id": 5, "content": "<bos>"}
    data["added_tokens"].insert(0, second)
    path.write_text(json.dumps(data))
    return path


def test_a_version_line_in_old_style_merges_is_skipped_as_the_library_skips_it(tmp_path: Path) -> None:
    path = _small(tmp_path)
    data = json.loads(path.read_text())
    data["model"]["vocab"].update({"#version": 4, "s": 5, "#versions": 6})
    data["model"]["merges"] = ["#version s", "a b"]
    data["added_tokens"][0]["id"] = 7
    path.write_text(json.dumps(data))
    built = tokenizer_build._build(path.read_text())
    assert built is not None
    _same(built, path)
    assert built.encode("#versions").ids == Tokenizer.from_file(str(path)).encode("#versions").ids


CANNOT = ["gap in added ids", "word-level model", "added out of id order", "mixed merge forms",
          "added token missing a field", "added id a float"]


@pytest.mark.parametrize("case", CANNOT)
def test_what_the_python_path_cannot_read_exactly_goes_to_the_library(tmp_path: Path, case: str) -> None:
    """To the library's parse: its object, or its error (a file it refuses is refused)."""
    if case in ("gap in added ids", "mixed merge forms", "added token missing a field", "added id a float"):
        path = _small(tmp_path)
        data = json.loads(path.read_text())
        if case == "gap in added ids":  # id 9 cannot come out of adding after a 4-token vocabulary
            data["added_tokens"][0]["id"] = 9
        elif case == "mixed merge forms":
            data["model"]["vocab"]["abc"] = 5
            data["added_tokens"][0]["id"] = 6
            data["model"]["merges"] = ["a b", ["ab", "c"]]
        elif case == "added token missing a field":
            del data["added_tokens"][0]["single_word"]
        else:
            data["added_tokens"][0]["id"] = 4.0
        path.write_text(json.dumps(data))
    elif case == "added out of id order":  # the library numbers them in the file's order
        path = _two_added(tmp_path)
    else:
        from tokenizers.models import WordLevel

        path = tmp_path / "tokenizer.json"
        Tokenizer(WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(path))
    assert tokenizer_build._build(path.read_text()) is None
    try:
        library = Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the library refuses it: so must we
        with pytest.raises(type(exc)):
            tokenizer_build.parse(path)
        return
    parsed = tokenizer_build.parse(path)
    assert json.loads(parsed.to_str()) == json.loads(library.to_str())
    assert [parsed.id_to_token(i) for i in range(8)] == [library.id_to_token(i) for i in range(8)]


def test_a_broken_file_raises_the_library_error(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [["a", "zz"]]}}')
    with pytest.raises(Exception, match="zz|[Mm]erge"):
        tokenizer_build.parse(path)
