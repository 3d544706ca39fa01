"""Nothing read that is not checked: files the manifest does not list are never loaded,
links never followed out of the container, and the dense core is hashed at open."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers_engine import engine_config
from helpers_server import own_copy

from pipeline.cli import main
from pipeline.engine import open_engine
from qpack import spec
from qpack.reader import Container, verify_container
from qpack.spec import QpackError

MESSAGES = [{"role": "user", "content": "Hello"}]
EVIL = "{% for m in messages %}INJECTED {{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def tiny(synth_checkpoint, packed, tmp_path_factory) -> Path:
    return own_copy(packed(synth_checkpoint("qwen3_next"), bits=None), tmp_path_factory, "edges-integrity")


@pytest.fixture
def copy(tiny, tmp_path) -> Path:
    out = tmp_path / "copy.qpack"
    shutil.copytree(tiny, out)
    return out


async def _prompt_tokens(root: Path) -> list[int]:
    async with open_engine(engine_config(root)) as engine:
        return engine.chat_tokens(MESSAGES)


async def test_unlisted_files_and_links_out_do_not_change_the_prompt(tiny, copy, tmp_path):
    clean = await _prompt_tokens(tiny)
    assert "chat_template.jinja" not in {f.path for f in Container.open(tiny).manifest.files}

    (copy / "chat_template.jinja").write_text(EVIL)  # dropped in: not in the manifest
    assert verify_container(copy).ok  # verify checks what is listed...
    assert await _prompt_tokens(copy) == clean  # ...and only that is ever loaded

    (copy / "chat_template.jinja").unlink()
    outside = tmp_path / "outside.jinja"
    outside.write_text(EVIL)
    (copy / "chat_template.jinja").symlink_to(outside)  # a link out of the container
    assert await _prompt_tokens(copy) == clean


def test_a_listed_file_replaced_by_a_link_is_refused(copy, tmp_path):
    outside = tmp_path / "tokenizer_config.json"
    shutil.copy(copy / "tokenizer_config.json", outside)  # same bytes, but outside
    (copy / "tokenizer_config.json").unlink()
    (copy / "tokenizer_config.json").symlink_to(outside)
    with pytest.raises(QpackError, match="outside the container|symbolic link"):
        Container.open(copy)


def test_an_edited_tokenizer_file_is_refused_at_open(copy):
    path = copy / "tokenizer_config.json"
    text = path.read_text()
    assert "<|im_start|>" in text
    path.write_text(text.replace("<|im_start|>", "<|im_stort|>", 1))  # same size, other bytes
    with pytest.raises(QpackError, match=r"tokenizer_config.json: sha256 .* \(changed or corrupted"):
        Container.open(copy)


def test_a_flipped_byte_in_the_dense_core_is_caught_at_open_by_default(copy, capsys):
    path = copy / spec.DENSE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside some weight: it would decode silently
    path.write_bytes(bytes(data))
    with pytest.raises(QpackError, match="dense.safetensors: sha256"):
        Container.open(copy)  # default verify = "first-use"
    Container.open(copy, verify="off").close()  # "off" means off
    assert main(["generate", str(copy), "--prompt", "Hi", "--slots", "16", "--prefill-chunk", "2"]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "dense.safetensors: sha256" in err and "Traceback" not in err


def test_a_byte_flipped_after_an_open_is_caught_at_the_next(copy, monkeypatch):
    """An unchanged file is hashed once per process (qpack/checked_files.py: reopened
    engines skip the dense core's hash); one written since, even in place and to the same
    size, is hashed again at the next open. A file written within the last seconds is not
    recorded at all (its times could stay as they are through a second write)."""
    from qpack import checked_files

    path = copy / spec.DENSE

    def key() -> tuple[int, int, int, int, int]:
        st = path.stat()
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    Container.open(copy).close()
    assert key() not in checked_files._hashed  # just copied: too fresh to record
    monkeypatch.setattr(checked_files, "_SETTLED_NS", 0)
    Container.open(copy).close()
    assert key() in checked_files._hashed
    Container.open(copy).close()  # unchanged: from the record
    size = path.stat().st_size
    with path.open("r+b") as fh:  # in place: same inode, same size
        fh.seek(size // 2)
        byte = fh.read(1)
        fh.seek(size // 2)
        fh.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(QpackError, match="dense.safetensors: sha256"):
        Container.open(copy)
