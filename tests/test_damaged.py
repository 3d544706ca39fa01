"""Each kind of damaged container is refused with its own error naming file and problem."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from qpack import spec
from qpack.reader import Container, ExpertCorrupt, verify_container
from qpack.spec import QpackError


@pytest.fixture
def good(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next", dtype="bfloat16"), bits=4)


@pytest.fixture
def copy(good, tmp_path) -> Path:
    out = tmp_path / "copy.qpack"
    shutil.copytree(good, out)
    return out


def _edit_manifest(root: Path, change: Callable[[dict], None]) -> None:
    path = root / spec.MANIFEST
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _refused(root: Path, pattern: str, names: str | None = None) -> None:
    with pytest.raises(QpackError, match=pattern) as info:
        Container.open(root)
    assert str(names or root) in info.value.path
    report = verify_container(root)  # verify reports the same problem instead of raising
    assert not report.ok and pattern.split("(")[0].split("\\")[0][:10] in report.problems[0]


def test_the_intact_container_opens(good):
    Container.open(good, verify="full").close()
    assert verify_container(good).ok


def test_missing_directory(tmp_path):
    with pytest.raises(QpackError, match="no such container"):
        Container.open(tmp_path / "nope.qpack")


def test_no_manifest_is_an_incomplete_container(copy):
    (copy / spec.MANIFEST).unlink()
    _refused(copy, r"incomplete container \(no manifest.json\); re-run pack to resume")


def test_truncated_layer_file(copy):
    path = copy / spec.layer_file(2)
    path.write_bytes(path.read_bytes()[:-5000])
    _refused(copy, r"is \d+ bytes, manifest says \d+ \(truncated", names=str(path))


def test_missing_layer_file(copy):
    (copy / spec.layer_file(0)).unlink()
    _refused(copy, "listed in the manifest but missing", names="layer_000.bin")


def test_flipped_byte_in_an_expert_is_caught_by_its_crc(copy):
    m = Container.open(copy).manifest
    entry = m.layer(3)
    with open(copy / entry.file, "r+b") as f:
        f.seek(9 * entry.stride + 100)
        byte = f.read(1)
        f.seek(9 * entry.stride + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    with Container.open(copy) as c:  # sizes are intact: only the payload check can see it
        with pytest.raises(ExpertCorrupt, match="layer 3 expert 9: crc32") as info:
            c.read_expert(3, 9, bytearray(entry.stride))
        assert info.value.path.endswith("layer_003.bin")


def test_foreign_magic(copy):
    _edit_manifest(copy, lambda d: d.update(magic="GGUF"))
    _refused(copy, r"not a qpack container \(magic 'GGUF', expected 'QPACK'\)")


def test_newer_version(copy):
    _edit_manifest(copy, lambda d: d.update(version=2, new_field=1))
    _refused(copy, r"container version 2 is newer than this moestream supports \(1\)")


def test_bad_json(copy):
    (copy / spec.MANIFEST).write_text('{"magic": "QPACK", ')
    _refused(copy, "manifest is not valid JSON")


def test_deeply_nested_manifest(copy):
    """Nesting past Python's recursion limit is the manifest's problem, not a RecursionError."""
    text = (copy / spec.MANIFEST).read_text()
    (copy / spec.MANIFEST).write_text(text.rstrip()[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _refused(copy, "nested too deeply to be a valid qpack manifest")


def test_deeply_nested_config(copy):
    (copy / spec.CONFIG).write_text('{"a": ' + "[" * 100_000)
    _refused(copy, "nested too deeply to be a valid config.json", names="config.json")


def test_schema_error(copy):
    _edit_manifest(copy, lambda d: d.update(top_k="eight"))
    _refused(copy, "does not match the qpack v1 schema")


def test_path_escaping_the_container(copy):
    def escape(d: dict) -> None:
        d["layers"][0]["file"] = "../../etc/passwd"
    _edit_manifest(copy, escape)
    _refused(copy, "is not a plain relative path inside the container")

    def absolute(d: dict) -> None:
        d["files"][0]["path"] = "/etc/passwd"
    _edit_manifest(copy, absolute)
    _refused(copy, "is not a plain relative path")


def test_symlink_out_of_the_container(copy, tmp_path):
    outside = tmp_path / "outside.bin"
    target = copy / spec.layer_file(1)
    outside.write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(outside)
    _refused(copy, "points outside the container")


def test_overlapping_offsets(copy):
    def overlap(d: dict) -> None:
        d["layers"][1]["format"]["tensors"][1]["offset"] = 1024  # inside gate_proj.weight
    _edit_manifest(copy, overlap)
    _refused(copy, r"layer 1: tensor gate_proj.scales at offset 1024 overlaps")


def test_negative_offset(copy):
    def negative(d: dict) -> None:
        d["layers"][0]["format"]["tensors"][0]["offset"] = -64
    _edit_manifest(copy, negative)
    _refused(copy, "negative offset -64")


def test_stride_smaller_than_the_format(copy):
    def shrink(d: dict) -> None:
        d["layers"][2]["stride"] = 4096
    _edit_manifest(copy, shrink)
    _refused(copy, r"layer 2: stride 4096 is smaller than the expert format's \d+ bytes")


def test_absurd_sizes(copy):
    def more_experts(d: dict) -> None:
        d["layers"][0]["stride"] *= 2
    _edit_manifest(copy, more_experts)
    _refused(copy, r"16 experts x stride 32768 = 524288 bytes, but the file is 262144", names="layer_000.bin")


def test_tensor_size_inconsistent_with_shape(copy):
    def lie(d: dict) -> None:
        d["layers"][0]["format"]["tensors"][0]["shape"] = [64, 800]
    _edit_manifest(copy, lie)
    _refused(copy, r"tensor gate_proj.weight uint32\[64, 800\] cannot be")


def test_config_model_type_mismatch(copy):
    config = json.loads((copy / spec.CONFIG).read_text())
    config["model_type"] = "llama"
    (copy / spec.CONFIG).write_text(json.dumps(config))
    _refused(copy, r"config.json model_type 'llama' does not match the manifest's 'qwen3_next'",
             names="config.json")


def test_config_bad_json(copy):
    (copy / spec.CONFIG).write_text("{not json")
    _refused(copy, "config.json is not valid JSON", names="config.json")


def test_verify_collects_every_problem(copy):
    text = (copy / spec.CONFIG).read_text()
    (copy / spec.CONFIG).write_text(text[:-1] + " ")  # same size and JSON, other bytes
    path = copy / spec.layer_file(0)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    data[16384 * 3 + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = verify_container(copy).problems
    assert len(problems) == 4, problems
    assert any("config.json: sha256" in p for p in problems)
    assert any("layer_000.bin: sha256" in p for p in problems)
    assert any("layer 0 expert 0: crc32" in p for p in problems)
    assert any("layer 0 expert 3: crc32" in p for p in problems)
