"""Packing straight from a hub repo id, against a local HTTP server speaking the subset of
the hub API huggingface_hub uses (tests/helpers_hub.py). The first download of the largest
shard is cut off mid-file and must be resumed."""

from __future__ import annotations

import json

import pytest
from helpers_hub import DOWNLOAD_CHUNK_SIZE, REPO_ID, FakeHub, use_hub

from qpack import spec
from qpack.hub import resolve_source, wanted
from qpack.spec import QpackError
from qpack.writer import pack


@pytest.fixture
def hub(synth_checkpoint, tmp_path, monkeypatch):
    fake = use_hub(FakeHub(synth_checkpoint("qwen3_next", dtype="bfloat16")), tmp_path, monkeypatch)
    yield fake
    fake.close()


def test_pack_from_the_hub_equals_pack_from_disk_after_a_cut_download(hub, tmp_path):
    local = tmp_path / "local.qpack"
    pack(hub.root, local, bits=4, progress=False)
    remote = tmp_path / "remote.qpack"
    pack(REPO_ID, remote, bits=4, progress=False)

    assert hub.cut_done
    resumed = [r for r in hub.requests if r[0] == "GET" and r[1].endswith(hub.cut) and r[2]]
    assert resumed == [("GET", resumed[0][1], f"bytes={DOWNLOAD_CHUNK_SIZE}-")], "resumed with a Range request"
    assert not any(r[1].endswith("README.md") for r in hub.requests if r[0] == "GET")
    for p in sorted(local.rglob("*")):
        rel = p.relative_to(local)
        if p.is_file() and str(rel) != spec.MANIFEST:
            assert (remote / rel).read_bytes() == p.read_bytes(), rel
    manifest = json.loads((remote / spec.MANIFEST).read_text())
    assert manifest["source"] == REPO_ID

    hub.requests.clear()  # a second pack reads from the cache: no file bodies fetched again
    pack(REPO_ID, tmp_path / "again.qpack", bits=4, progress=False)
    assert not [r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]


def test_resolve_source_errors_name_the_problem(hub, tmp_path):
    with pytest.raises(QpackError, match="acme/missing: repository not found"):
        resolve_source("acme/missing", progress=False)
    with pytest.raises(QpackError, match="neither a checkpoint directory nor a hub repo id"):
        resolve_source(str(tmp_path / "no" / "such" / "dir"), progress=False)
    with pytest.raises(QpackError, match="revision 'v9' not found"):
        resolve_source(REPO_ID, revision="v9", progress=False)
    assert resolve_source(str(hub.root)) == hub.root


def test_only_needed_files_are_downloaded():
    assert wanted("config.json") and wanted("model-00001-of-00002.safetensors")
    assert wanted("tokenizer.json") and wanted("model.safetensors.index.json")
    assert not wanted("README.md") and not wanted("pytorch_model.bin")
    assert not wanted("original/model.safetensors")


def test_a_hub_pack_resumes_only_from_the_same_commit(hub, tmp_path):
    """A pack's journal records the commit its files came from: a pack left half done
    before the repo moved on is not finished from the new commit's files."""
    import msgspec

    from qpack.spec import JOURNAL
    from qpack.writer import Journal

    out = tmp_path / "moved.qpack"
    out.mkdir()
    options = {"source": REPO_ID, "bits": 4, "group_size": 64, "dtype": None, "revision": None,
               "commit": "f" * 40}  # what a pack of an earlier commit left
    (out / JOURNAL).write_bytes(msgspec.json.encode(Journal(options)))
    with pytest.raises(QpackError, match="other options is in progress here .*'commit'"):
        pack(REPO_ID, out, bits=4, progress=False)

