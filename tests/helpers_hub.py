"""A local HTTP server speaking the subset of the hub API huggingface_hub uses (model info
with siblings; HEAD/GET of resolve URLs with ETag, X-Repo-Commit and Range), serving one
checkpoint directory as a repo. With `cut`, the first download of the largest shard is cut
off mid-file (the client must resume it)."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

# huggingface_hub's download chunk while `use_hub` points it at a FakeHub (its own: 10 MiB,
# larger than a tiny checkpoint's shards), so a cut falls after whole chunks it resumes from.
DOWNLOAD_CHUNK_SIZE = 256 * 1024

REPO_ID = "acme/tiny-next"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, root: Path, cut: bool = True) -> None:
        self.root = root
        self.files = {p.name: p for p in sorted(root.iterdir()) if p.is_file()}
        self.files.setdefault("README.md", None)  # listed, never needed
        self.cut = None
        if cut:
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




def use_hub(fake: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """Point huggingface_hub at `fake`, with a fresh cache under tmp_path."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", DOWNLOAD_CHUNK_SIZE)
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return fake
