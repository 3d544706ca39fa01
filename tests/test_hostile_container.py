"""Hostile containers and configs: only the documented errors ever escape.

tests/test_damaged.py covers one hand-made damage per check. This file adds what it
does not (backslash and directory paths, a file listed twice, duplicated layers,
checksum count, alignment, top_k, dense_bytes, overflowing shapes), a property test
that mutates a real manifest at random (Container.open and the expert views must
either work or raise QpackError, and never open a file outside the container), fuzzed
bytes for the manifest decoder, fuzzed TOML for the config loader (ConfigError only),
and a config.json or tokenizer that does not match the packed weights.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pipeline.config.errors import ConfigError
from pipeline.config.loading import config_from_dict, load_config
from pipeline.config.schema import PipelineConfig
from qpack import spec
from qpack.reader import Container
from qpack.spec import QpackError

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# -- every file opened while a check runs (audit hook: sees io.open and os.open) ------------

_opened: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def _audited(fn: Callable[[], Any]) -> tuple[QpackError | None, list[str]]:
    """Run `fn`; the QpackError it raised (if any) and every path it opened. Any other
    exception propagates: that is a failure."""
    global _opened
    _opened = opened = []
    try:
        fn()
    except QpackError as exc:
        return exc, opened
    finally:
        _opened = None
    return None, opened


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next", dtype="bfloat16"), bits=4)


@pytest.fixture
def box(good, tmp_path) -> Path:
    """A copy of the container next to a secret file and a symlink inside pointing at it."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * 16384 * 16)
    root = tmp_path / "box" / "c.qpack"
    shutil.copytree(good, root)
    (root / "link_out").symlink_to(secret)
    return root


def _manifest(root: Path) -> dict[str, Any]:
    return json.loads((root / spec.MANIFEST).read_text())


def _write(root: Path, doc: Any) -> None:
    (root / spec.MANIFEST).write_text(json.dumps(doc))


def _open_and_use(root: Path) -> None:
    """Open, then touch every layer the way the engine does: read expert 0, view its tensors."""
    with Container.open(root) as c:
        buf = bytearray(c.manifest.max_stride)
        for index in c.moe_layers:
            c.read_expert(index, 0, buf)
            c.expert_views(buf, index)


def _refused_inside(root: Path, match: str) -> None:
    error, opened = _audited(lambda: _open_and_use(root))
    assert error is not None and re.search(match, str(error)), error
    _assert_inside(root, opened)


def _assert_inside(root: Path, opened: list[str]) -> None:
    base = root.resolve()
    outside = [p for p in opened if base not in Path(p).resolve().parents]
    assert outside == [], f"opened outside the container: {outside}"


# -- single damages test_damaged.py does not have ----------------------------------------------


@pytest.mark.parametrize("path, match", [
    ("experts\\layer_000.bin", "not a plain relative path"),
    ("", "not a plain relative path"),
    ("experts//layer_000.bin", "not a plain relative path"),
    ("link_out", "points outside the container"),
    ("experts", "listed in the manifest but missing"),  # a directory is not a file
    ("a\x00b", "not a plain relative path"),
])
def test_layer_file_paths(box, path, match):
    doc = _manifest(box)
    old = doc["layers"][0]["file"]
    doc["layers"][0]["file"] = path
    for f in doc["files"]:
        if f["path"] == old:
            f["path"] = path
    _write(box, doc)
    _refused_inside(box, match)


@pytest.mark.parametrize("change, match", [
    (lambda d: d["files"].append(dict(d["files"][0])), "is listed twice"),
    (lambda d: d["layers"][1].update(index=d["layers"][0]["index"]), "index duplicated"),
    (lambda d: d["layers"][0].update(index=99), r"index duplicated or outside 0\.\.3"),
    (lambda d: d["layers"][0].update(file="config.json"), "16 experts x stride"),
    (lambda d: d["layers"][2].update(checksums=d["layers"][2]["checksums"][:-1]), "15 checksums"),
    (lambda d: d.update(alignment=100), "alignment 100 is not a positive multiple of 64"),
    (lambda d: d.update(alignment=0), "alignment 0 is not a positive multiple"),
    (lambda d: d.update(top_k=0), r"top_k 0 is not within 1\.\.num_experts"),
    (lambda d: d.update(top_k=17), r"top_k 17 is not within 1\.\.num_experts \(16\)"),
    (lambda d: d.update(dense_bytes=1), "dense_bytes 1 != size of dense.safetensors"),
    (lambda d: d.update(files=[f for f in d["files"] if f["path"] != "config.json"]),
     "does not list config.json"),
    (lambda d: d["layers"][0]["format"]["tensors"][0].update(shape=[2**32, 2**32], nbytes=0),
     "cannot be 0 bytes"),
    (lambda d: d["layers"][0]["format"]["tensors"][0].update(shape=[2**70]), "cannot be"),
    (lambda d: d["layers"][0]["format"].update(nbytes=10), "past the format's nbytes 10"),
    (lambda d: d["layers"][0]["format"]["tensors"][0].update(dtype="int4"), "schema"),
    (lambda d: d["layers"][0]["format"].update(
        tensors=[t for t in d["layers"][0]["format"]["tensors"] if t["name"] != "up_proj.weight"]),
     "has no up_proj.weight"),
    (lambda d: d["layers"][0].update(stride=-16384), "stride -16384 is smaller"),
    (lambda d: d["layers"][0].update(num_experts=2**40, stride=16384), "experts"),
])
def test_manifest_lies(box, change, match):
    doc = _manifest(box)
    change(doc)
    _write(box, doc)
    _refused_inside(box, match)


# -- property: a randomly mutated manifest -----------------------------------------------------

_HOSTILE_PATHS = ["../secret.bin", "/etc/passwd", "experts/../../secret.bin", "link_out", ".",
                  "experts", "manifest.json", "config.json", "experts/layer_001.bin",
                  "~/x", "experts\\..\\..\\secret.bin", "x" * 300]
# (A NUL in a manifest path is a case of test_layer_file_paths; configs get it too.)
_CONFIG_STRINGS = [*_HOSTILE_PATHS, "a\x00b"]
_INTS = st.one_of(st.integers(-(2**70), 2**70),
                  st.sampled_from([0, -1, 1, 64, 16384, -16384, 2**31, 2**32, 2**63 - 1, 2**63,
                                   2**64, 2**64 + 1]))
_SCALARS = st.one_of(st.none(), st.booleans(), _INTS, st.floats(), st.text(max_size=12),
                     st.sampled_from(_HOSTILE_PATHS))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def _paths(node: Any, at: tuple = ()) -> list[tuple]:
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*at, i))
    return out


def _parent(doc: Any, at: tuple) -> Any:
    for p in at[:-1]:
        doc = doc[p]
    return doc


def _same_kind(value: Any) -> st.SearchStrategy[Any]:
    """Mostly type-preserving replacements, so that most mutants get past the schema."""
    if isinstance(value, bool) or value is None:
        return _VALUES
    if isinstance(value, int):
        return _INTS
    if isinstance(value, str):
        return st.sampled_from(_HOSTILE_PATHS) | st.text(max_size=12)
    if isinstance(value, list):
        return st.lists(_INTS, max_size=4)  # shapes, checksums
    return _VALUES


@st.composite
def _mutated(draw: st.DrawFn, base: dict[str, Any]) -> Any:
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.sampled_from(_paths(doc)[1:]))
        parent, key = _parent(doc, at), at[-1]
        value = parent[key]
        op = draw(st.sampled_from(["same", "same", "same", "scale", "scale", "delete", "retype",
                                   "add"]))
        if op == "delete":
            del parent[key]
        elif op == "scale" and isinstance(value, int) and not isinstance(value, bool):
            parent[key] = value * draw(st.sampled_from([-1, 0, 2, 3, 2**20, 2**40])) + draw(
                st.sampled_from([0, 1, -1, 64]))
        elif op == "add" and isinstance(value, dict):
            value[draw(st.text(max_size=8))] = draw(_VALUES)
        elif op == "add" and isinstance(value, list):
            value.append(draw(_same_kind(value[0]) if value else _VALUES))
        elif op == "retype":
            parent[key] = draw(_VALUES)
        else:
            parent[key] = draw(_same_kind(value))
    return doc


def test_mutated_manifests_fail_only_with_qpack_errors(good, box):
    base = _manifest(good)

    @FUZZ
    @given(doc=_mutated(base))
    def check(doc: Any) -> None:
        _write(box, doc)
        error, opened = _audited(lambda: _open_and_use(box))
        event("refused" if error else "opened and used")
        _assert_inside(box, opened)

    check()


@FUZZ
@given(data=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode),
                      _VALUES.map(lambda v: json.dumps(v).encode())))
def test_manifest_decoder_fails_only_with_qpack_errors(data):
    try:
        spec.decode_manifest(data, Path("m.json"))
    except QpackError as exc:
        assert "m.json" in str(exc)


# -- fuzzed pipeline configs ------------------------------------------------------------------

_SECTIONS = {f.name: f.type for f in msgspec.structs.fields(PipelineConfig)}
_KEYS = {name: [f.name for f in msgspec.structs.fields(tp)] for name, tp in _SECTIONS.items()}
_TOML_SCALARS = st.one_of(st.booleans(), _INTS.filter(lambda i: -(2**63) <= i < 2**63),
                          st.floats(), st.text(max_size=12), st.sampled_from(_CONFIG_STRINGS))
_TOML_VALUES = st.recursive(_TOML_SCALARS, lambda inner: st.lists(inner, max_size=3)
                            | st.dictionaries(st.text(max_size=6), inner, max_size=2), max_leaves=6)


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v == float("inf") else "-inf" if v == -float("inf")
                                     else repr(v))
    if isinstance(v, str):
        return json.dumps(v)  # JSON string escapes are TOML basic-string escapes
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml(x)}" for k, x in v.items()) + "}"


@st.composite
def _config_text(draw: st.DrawFn) -> str:
    lines = []
    for section in draw(st.lists(st.sampled_from([*_SECTIONS, "extra"]), max_size=5, unique=True)):
        lines.append(f"[{section}]")
        names = st.sampled_from(_KEYS.get(section, ["x"])) | st.text("abc_", min_size=1, max_size=5)
        for key in draw(st.lists(names, max_size=4, unique=True)):
            lines.append(f"{json.dumps(key)} = {_toml(draw(_TOML_VALUES))}")
    return "\n".join(lines) + "\n"


@st.composite
def _spliced_example(draw: st.DrawFn) -> str:
    text = (Path(__file__).resolve().parents[1] / "config" / "demo.toml").read_text()
    start = draw(st.integers(0, len(text)))
    stop = draw(st.integers(start, min(len(text), start + 40)))
    return text[:start] + draw(st.text(max_size=20)) + text[stop:]


@FUZZ
@given(text=st.one_of(_config_text(), _spliced_example(), st.text(max_size=100)),
       overrides=st.lists(st.text(max_size=20) | st.sampled_from(
           ["model.path=\x00", "pool.slots=-1", "a..b=1", "model.path.x=1", "server.port=1e9",
            "pool=3", "sampling.temperature=nan", "reader.retries=99999999999999999999"]),
           max_size=2))
def test_fuzzed_config_text_fails_only_with_config_errors(tmp_path_factory, text, overrides):
    path = tmp_path_factory.getbasetemp() / "fuzz.toml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    for check_paths in (True, False):
        try:
            load_config(path, overrides, check_paths=check_paths)
        except ConfigError as exc:
            assert str(exc)


@FUZZ
@given(raw=st.dictionaries(st.sampled_from([*_SECTIONS, "x"]),
                           st.dictionaries(st.text(max_size=8) | st.sampled_from(
                               sum(_KEYS.values(), [])), _TOML_VALUES, max_size=4)
                           | _TOML_VALUES, max_size=4))
def test_fuzzed_config_dicts_fail_only_with_config_errors(raw):
    try:
        config_from_dict(raw)
    except ConfigError as exc:
        assert str(exc)


# -- config.json or tokenizer that does not match the packed weights ---------------------------
# Each edit also fixes the sizes in the manifest (a consistent lie): only the content is wrong.

def _resize(root: Path) -> None:
    doc = _manifest(root)
    doc["files"] = [dict(f, size=(root / f["path"]).stat().st_size) for f in doc["files"]
                    if (root / f["path"]).exists()]
    _write(root, doc)


def _edit_config(root: Path, **changes: Any) -> None:
    config = json.loads((root / spec.CONFIG).read_text())
    config.update(changes)
    (root / spec.CONFIG).write_text(json.dumps(config))
    _resize(root)


async def _open_engine_and_generate(root: Path) -> None:
    from actors.sampling_params import SamplingParams
    from pipeline.engine import open_engine

    config = config_from_dict({"model": {"path": str(root)}, "pool": {"slots": 16},
                               "compute": {"prefill_chunk": 4}})
    async with open_engine(config) as engine:
        async for _ in engine.generate("Hello", SamplingParams(max_tokens=1)):
            pass


@pytest.mark.parametrize("changes, match", [
    ({"hidden_size": 128}, "config.json|dense.safetensors"),
    ({"num_experts": 32}, "num_experts"),
    ({"num_experts_per_tok": 8}, "num_experts_per_tok|top_k"),
    ({"num_hidden_layers": 6}, "num_hidden_layers|dense tensors do not match"),
])
async def test_config_that_does_not_match_the_weights(box, changes, match):
    _edit_config(box, **changes)
    with pytest.raises(QpackError, match=match):
        await _open_engine_and_generate(box)


async def test_garbled_tokenizer_is_refused_naming_it(box):
    (box / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    _resize(box)
    with pytest.raises(QpackError, match="tokenizer.json"):
        await _open_engine_and_generate(box)


async def test_missing_tokenizer_is_refused_at_open(box):
    (box / "tokenizer.json").unlink()
    _resize(box)
    with pytest.raises(QpackError, match="tokenizer"):
        await _open_engine_and_generate(box)
