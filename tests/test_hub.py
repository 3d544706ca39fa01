"""Packing straight from a hub repo id, against a local HTTP server speaking the subset of
the hub API huggingface_hub uses (model info with siblings; HEAD/GET of resolve URLs with
ETag, X-Repo-Commit and Range). The first download of the largest shard is cut off
mid-file and must be resumed."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE

from qpack import spec
from qpack.hub import resolve_source, wanted
from qpack.spec import QpackError
from qpack.writer import pack

REPO_ID = "acme/tiny-next"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = {p.name: p for p in sorted(root.iterdir()) if p.is_file()}
        self.files["README.md"] = None  # listed, never needed
        self.cut = max((n for n in self.files if n.endswith(".safetensors")),
                       key=lambda n: self.files[n].stat().st_size)
        assert self.files[self.cut].stat().st_size > DOWNLOAD_CHUNK_SIZE + 4096
        self.cut_done = False
        self.requests: list[tuple[str, str, str | None]] = []
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.serve(self, body=False)

            def do_GET(self) -> None:
                hub.serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _send(self, h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], data: bytes, body: bool) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)) if "Content-Length" not in headers else headers["Content-Length"])
        h.end_headers()
        if body:
            h.wfile.write(data)

    def serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?")[0]
        with self.lock:
            self.requests.append((h.command, path, h.headers.get("Range")))
        if m := re.fullmatch(rf"/api/models/{REPO_ID}(?:/revision/([^/]+))?", path):
            if m[1] not in (None, "main", COMMIT):
                return self._send(h, 404, {"X-Error-Code": "RevisionNotFound"}, b'{"error":"no rev"}', body)
            info = {"id": REPO_ID, "sha": COMMIT, "siblings": [{"rfilename": n} for n in self.files]}
            return self._send(h, 200, {"Content-Type": "application/json"}, json.dumps(info).encode(), body)
        if path.startswith("/api/models/"):
            return self._send(h, 404, {"X-Error-Code": "RepoNotFound"}, b'{"error":"no repo"}', body)
        m = re.fullmatch(rf"/{REPO_ID}/resolve/([^/]+)/(.+)", path)
        if not m or m[1] not in ("main", COMMIT) or m[2] not in self.files:
            return self._send(h, 404, {"X-Error-Code": "EntryNotFound"}, b"not found", body)
        data = self.files[m[2]].read_bytes() if self.files[m[2]] else b"# readme\n"
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": COMMIT,
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        rng = h.headers.get("Range")
        if rng:
            start = int(re.fullmatch(r"bytes=(\d+)-", rng)[1])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return self._send(h, 206, headers, data[start:], body)
        if body and m[2] == self.cut and not self.cut_done:
            self.cut_done = True
            headers["Content-Length"] = str(len(data))
            self._send(h, 200, headers, b"", body=False)
            # huggingface_hub writes (and so resumes from) whole DOWNLOAD_CHUNK_SIZE chunks
            h.wfile.write(data[: min(len(data) - 1, DOWNLOAD_CHUNK_SIZE + 4096)])
            h.wfile.flush()
            h.connection.shutdown(socket.SHUT_RDWR)  # the connection drops mid-file
            h.close_connection = True
            return
        self._send(h, 200, headers, data, body)


@pytest.fixture
def hub(synth_checkpoint, tmp_path, monkeypatch):
    fake = FakeHub(synth_checkpoint("qwen3_next", dtype="bfloat16"))
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
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
