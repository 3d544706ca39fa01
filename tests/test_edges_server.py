"""The server at its edges: a per-request token limit, a /health that looks at the files,
and a shutdown that tells every client what happened."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx2
import pytest
import trio
from helpers_server import serving
from test_server_errors import CHAT, body, error_of, no_eos, running_server, sse_chunks, until

from qpack.writer import pack


@pytest.fixture(scope="module")
def container(synth_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("edges-server") / "tiny.qpack"
    pack(synth_checkpoint("qwen3_next"), out, bits=None, progress=False)
    return out


async def test_max_tokens_over_the_limit_is_a_400(container: Path) -> None:
    async with running_server(container, max_tokens_limit=3) as (_, http):
        err = error_of(await http.post(CHAT, json=body(max_tokens=10**9)), 400)
        assert err["param"] == "max_tokens" and "over this server's limit of 3" in err["message"]
        err = error_of(await http.post(CHAT, json=body(max_tokens=None, max_completion_tokens=4)), 400)
        assert err["param"] == "max_completion_tokens"
        for extra in ({"max_tokens": None}, {"max_tokens": 2}):  # 0 is a bad value, not "unset"
            err = error_of(await http.post(CHAT, json=body(**extra, max_completion_tokens=0)), 400)
            assert err["param"] == "max_completion_tokens", err
            assert err["message"].startswith("max_completion_tokens must be >= 1"), err
        resp = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi",
                                                        "max_tokens": 10**9, "stream": True})
        assert error_of(resp, 400)["param"] == "max_tokens"
        # No length asked: at most the limit, not the whole context.
        unbounded = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        ok = await http.post(CHAT, json=unbounded)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 3
        ok = await http.post(CHAT, json=body(max_tokens=3))
        assert ok.status_code == 200
        # The other APIs and the unprefixed routes share the limit.
        err = error_of(await http.post("/chat/completions", json=body(max_tokens=4)), 400)
        assert err["param"] == "max_tokens"
        resp = await http.post("/v1/messages", json={"model": "tiny", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 400 and "limit of 3" in resp.json()["error"]["message"]
        assert resp.json()["type"] == "error"
        resp = await http.post("/v1/responses", json={"model": "tiny", "input": "hi"})
        assert resp.status_code == 200 and resp.json()["usage"]["output_tokens"] <= 3


async def test_health_reports_an_unreadable_layer_file(container: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.qpack"
    shutil.copytree(container, copy)
    layer = copy / "experts" / "layer_001.bin"
    async with running_server(copy) as (_, http):
        assert (await http.get("/health")).json()["status"] == "ok"
        saved = layer.read_bytes()
        os.truncate(layer, len(saved) // 2)
        resp = await http.get("/health")
        assert resp.status_code == 503, resp.text
        assert resp.json()["status"] == "error"
        assert any("layer_001.bin" in p for p in resp.json()["problems"])
        layer.unlink()
        assert "cannot open" in (await http.get("/health")).json()["problems"][0]
        layer.write_bytes(saved)
        assert (await http.get("/health")).status_code == 200


async def test_shutdown_503s_the_queue_and_ends_running_streams_with_an_error_event(container: Path) -> None:
    stop = trio.Event()
    async with running_server(container, shutdown_trigger=stop.wait, max_batch=1) as (engine, http):
        results: dict[str, httpx2.Response] = {}

        async def post(name: str, payload: dict) -> None:
            results[name] = await http.post(CHAT, json=payload)

        anthropic: list[str] = []

        async def queued_stream() -> None:
            # The status line waits for admission: refused while queued, it is a real 503.
            async with http.stream("POST", CHAT, json=body(max_tokens=2, stream=True)) as resp:
                await resp.aread()
                results["queued-stream"] = resp

        async def queued_anthropic_stream() -> None:
            # Its status line is out before it is queued: the refusal is its error event.
            async with http.stream("POST", "/v1/messages", json={
                    "model": "tiny", "max_tokens": 2, "stream": True,
                    "messages": [{"role": "user", "content": "hi"}]}) as resp:
                assert resp.status_code == 200
                anthropic.extend([line async for line in resp.aiter_lines()])

        async with trio.open_nursery() as nursery, \
                http.stream("POST", CHAT, json=body(max_tokens=3000, stream=True,
                                                    logit_bias=no_eos(engine))) as a:
            assert a.status_code == 200
            lines = a.aiter_lines()
            await sse_chunks(lines, 3)  # A is producing tokens
            nursery.start_soon(post, "queued", body(max_tokens=2))
            nursery.start_soon(queued_anthropic_stream)
            nursery.start_soon(queued_stream)
            await until(lambda: engine.waiting == 3)

            stop.set()  # SIGTERM's job: the same path the signal takes
            started = time.monotonic()
            await until(lambda: "queued" in results)
            queued = error_of(results["queued"], 503)
            assert queued["code"] == "server_shutting_down"
            await until(lambda: "queued-stream" in results)
            assert error_of(results["queued-stream"], 503)["code"] == "server_shutting_down"
            assert time.monotonic() - started < 2  # at once, not after the grace period
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "shutting_down"
            error_of(await http.post(CHAT, json=body()), 503)  # nothing new is admitted
            await until(lambda: "event: error" in anthropic)
            error = json.loads(anthropic[anthropic.index("event: error") + 1][6:])
            assert error["error"]["type"] == "api_error" and "shutting down" in error["error"]["message"]

            # A keeps streaming through the grace period, then gets one error event.
            rest = [line async for line in lines]
        events = [json.loads(line[6:]) for line in rest if line.startswith("data: ") and line != "data: [DONE]"]
        assert events and "choices" in events[0]
        assert events[-1]["error"]["code"] == "server_shutting_down", events[-1]
        assert all("choices" in e for e in events[:-1])
        assert time.monotonic() - started >= 2  # the grace period was given
    assert engine.waiting == 0 and not engine.busy


async def _health_on(stream: trio.SocketStream) -> bytes:
    """One GET /health on an open connection; its status line (b"" if it was closed)."""
    await stream.send_all(b"GET /health HTTP/1.1\r\nHost: moestream\r\n\r\n")
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some()
        if not data:
            return b""
        buf += data
    head, rest = buf.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(rest) < length:
        rest += await stream.receive_some()
    return head.split(b"\r\n")[0]


async def test_an_idle_keep_alive_connection_outlives_the_clients_own_pool_expiry(
        container: Path) -> None:
    # httpx (the openai and anthropic clients) drops a pooled connection idle for 5 s; a
    # server that closed its end at the same moment failed a request sent on it (session
    # 30's soak). The server keeps it longer, so the client always closes first.
    async with serving(container) as (_, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            assert (await _health_on(stream)).startswith(b"HTTP/1.1 200")
            await trio.sleep(5.5)
            assert (await _health_on(stream)).startswith(b"HTTP/1.1 200")


async def test_a_body_that_stops_coming_is_a_408_and_its_connection_closes(
        container: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers in, a body that never follows: answered and closed, not held open for good
    (hypercorn's idle timer stops at the headers; twenty such clients held twenty fds)."""
    from pipeline.server import api

    monkeypatch.setattr(api, "BODY_TIMEOUT_S", 0.5)
    async with serving(container) as (_, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                  b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                                  b'{"model": ')
            reply = b""
            with trio.fail_after(10):
                while chunk := await stream.receive_some():  # to the server's close
                    reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"request_timeout" in reply and b"did not arrive within" in reply


async def test_a_connection_the_client_closes_while_idle_is_closed_at_once(container: Path) -> None:
    """A client that ends an idle keep-alive connection (here half-closing it, so its end
    sees the server's close) gets the server's close at once, not after the 75 s
    keep-alive timer: hypercorn 0.18 waited for that timer before closing its socket, so
    every connection a client closed sat in CLOSE-WAIT, holding a descriptor, for 75 s."""
    import socket

    async with serving(container) as (_, port):
        for _ in range(3):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                assert (await _health_on(stream)).startswith(b"HTTP/1.1 200")
                await trio.sleep(0.2)  # the server has set its connection idle
                stream.socket.shutdown(socket.SHUT_WR)
                with trio.fail_after(5):
                    assert await stream.receive_some() == b""
