"""A container that goes bad under a running server: bytes flipped on disk, a layer file
made unreadable while serving.

The request that needs a damaged expert gets the damage and the fix as its error (503
`container_damaged`, JSON or the stream's error event), never a traceback; `/health`
names the damaged files from then on, and turns back to ok once the file is mended, as
does serving.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx2
import pytest
from structlog.testing import capture_logs
from test_server_errors import CHAT, body, running_server
from test_shutdown import Server

from qpack.reader import Container


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


def _flip_every_expert(path: Path, stride: int, count: int) -> None:
    """One byte of each expert blob, in place (same size, same inode: no stat notices)."""
    with open(path, "r+b") as f:
        for e in range(count):
            f.seek(e * stride + 17)
            byte = f.read(1)
            f.seek(e * stride + 17)
            f.write(bytes([byte[0] ^ 0x10]))


def _sse_last(resp: httpx2.Response) -> dict[str, Any]:
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    return json.loads(events[-1])


async def test_flipped_bytes_under_serve_are_named_and_health_turns(container: Path,
                                                                    tmp_path: Path) -> None:
    copy = tmp_path / "c.qpack"
    shutil.copytree(container, copy)
    entry = Container.open(copy, verify="off").manifest.layer(2)
    layer = copy / entry.file
    saved = layer.read_bytes()
    damaged = re.compile(r"expert \d+ of layer 2 failed its checksum: the container is damaged; "
                         rf"run moestream verify {re.escape(str(copy))}$")
    with capture_logs() as logs:
        async with running_server(copy) as (engine, http):
            assert (await http.get("/health")).json()["status"] == "ok"
            _flip_every_expert(layer, entry.stride, entry.num_experts)  # while serving
            assert (await http.get("/health")).status_code == 200  # nothing a stat can see

            resp = await http.post(CHAT, json=body())
            assert resp.status_code == 503, resp.text
            err = resp.json()["error"]
            assert damaged.match(err["message"]), err
            assert (err["type"], err["code"]) == ("server_error", "container_damaged")
            resp = await http.post(CHAT, json=body(stream=True))
            assert resp.status_code == 200
            event = _sse_last(resp)["error"]
            assert damaged.match(event["message"]) and event["code"] == "container_damaged"
            resp = await http.post("/v1/messages", json={
                "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert resp.status_code == 503 and resp.json()["type"] == "error", resp.text
            assert damaged.match(resp.json()["error"]["message"]), resp.text

            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "error"
            problems = health.json()["problems"]
            assert problems and all(p.startswith(f"{layer}: expert ") and
                                    p.endswith("of layer 2 failed its checksum") for p in problems)
            snap = engine.pool_snapshot()
            assert snap["pinned"] == 0 and snap["loads_in_flight"] == 0, snap

            layer.write_bytes(saved)  # mended: a new mtime, the experts read clean again
            assert (await http.get("/health")).status_code == 200
            # Greedy: a sampled reply may end at the end-of-text token first (2 % a call).
            resp = await http.post(CHAT, json=body(temperature=0))
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
    events = [e["event"] for e in logs]
    assert "server.container_damaged" in events and "container.damaged" in events
    assert not {"server.internal_error", "server.stream_failed"} & set(events), events
    assert not [e for e in logs if "exc_info" in e], "a traceback was logged"


def _post(port: int, path: str, payload: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(payload).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _get(port: int, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_layer_file_made_unreadable_under_moestream_serve(fork_server, container: Path,
                                                            tmp_path: Path) -> None:
    """`moestream serve` as a process of its own (bound by file permissions even when the
    tests run as root); `chmod 000` on a layer file while it serves, then back."""
    shared_copy = tmp_path / "c.qpack"
    shutil.copytree(container, shared_copy)
    layer = shared_copy / "experts" / "layer_001.bin"
    server = Server(fork_server, shared_copy, permissions=True)
    try:
        server.wait_for("server.listening")
        assert _get(server.port, "/health")[0] == 200
        layer.chmod(0)
        unreadable = re.compile(
            rf"expert \d+ of layer 1 cannot be read: {re.escape(str(layer))}: permission denied: "
            rf"make the file readable by this process, then run moestream verify "
            rf"{re.escape(str(shared_copy))}$")
        status, text = _post(server.port, CHAT, body())
        assert status == 503, text
        assert unreadable.match(json.loads(text)["error"]["message"]), text
        status, text = _post(server.port, CHAT, body(stream=True))
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert status == 200 and unreadable.match(json.loads(events[-1])["error"]["message"]), text
        status, health = _get(server.port, "/health")
        assert status == 503 and "experts/layer_001.bin: cannot open: Permission denied" in health["problems"]
        assert any(p.startswith(f"{layer}: expert ") for p in health["problems"]), health

        layer.chmod(0o644)  # mended: readable again, the damage record is re-examined
        assert _get(server.port, "/health")[0] == 200
        status, text = _post(server.port, CHAT, body(temperature=0))  # greedy: never cut short
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2, text
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    finally:
        layer.chmod(0o644)
        server.stop()
    output = "".join(server.log + list(server.lines.queue))
    assert "server.container_damaged" in output, output[-3000:]
    assert "Traceback" not in output and "server.internal_error" not in output, output[-3000:]
