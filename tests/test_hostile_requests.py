"""Hostile HTTP requests against a real hypercorn server on loopback, and security defaults.

The fuzz runs hypothesis in a worker thread with blocking stdlib HTTP (so bodies,
methods and headers can be anything) while the server runs in the test's trio loop.
Every answer must be a 4xx with an OpenAI error body, or a 200 for the few requests
that happen to be valid; never a 5xx, never a hang (each request has a timeout), and
the server keeps serving afterwards with a clean engine.
"""

from __future__ import annotations

import copy
import http.client
import inspect
import json
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from forked_cli import ForkedCLI
from helpers_server import serving
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config.schema import ServerConfig
from pipeline.engine import Engine
from pipeline.server import api as server_api
from pipeline.server.app import serve_engine
from pipeline.server.settings import ServerSettings

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TIMEOUT_S = 60  # per request: a hang fails the example instead of the whole run
KEY = "k3y-0f-t3sts"


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


@asynccontextmanager
async def running_server(container: Path, **serve_kw: Any) -> AsyncIterator[tuple[Engine, int]]:
    # A small context limit bounds any valid request the fuzz stumbles on.
    async with serving(container, {"context_limit": 40}, **serve_kw) as (engine, port):
        yield engine, port


def request(port: int, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def assert_error_body(status: int, data: bytes) -> dict[str, Any]:
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert "Traceback" not in err["message"]
    return err


def assert_answer(status: int, headers: dict[str, str], data: bytes) -> str:
    """A 4xx error body or a whole 200 reply; returns which, for the tally."""
    assert status < 500, (status, data[:500])
    if status >= 400:
        assert headers.get("content-type", "").startswith("application/json"), headers
        assert_error_body(status, data)
        return str(status)
    assert status == 200, (status, data[:300])
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", data[-300:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert "choices" in json.loads(data) or "data" in json.loads(data) or b"ok" in data
    return "200"


# -- what the fuzz sends -----------------------------------------------------------------------

VALID = {
    CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    COMPLETIONS: {"model": "tiny", "prompt": "hi", "max_tokens": 1},
}
_INTS = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from(
    [0, -1, 1, 2**31, 2**53 + 1, 2**63, 2**64, 10**400]))
_SCALARS = st.one_of(st.none(), st.booleans(), _INTS,
                     st.floats(allow_nan=False, allow_infinity=False), st.floats(),
                     st.text(max_size=30), st.sampled_from(["", "\x00", "\ud800", "tiny", "a" * 5000]))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
_FIELDS = ["model", "messages", "prompt", "temperature", "top_p", "n", "stream", "stop", "seed",
           "max_tokens", "max_completion_tokens", "presence_penalty", "frequency_penalty",
           "logit_bias", "tools", "tool_choice", "response_format", "stream_options", "user",
           "logprobs", "top_logprobs", "echo", "suffix", "best_of", "parallel_tool_calls"]


def _deep(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


def _encode(value: Any) -> bytes:
    # NaN/Infinity literals and lone surrogates are what a sloppy client sends.
    return json.dumps(value, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def _mutated_valid(draw: st.DrawFn, path: str) -> bytes:
    body = copy.deepcopy(VALID[path])
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["set", "set", "delete", "message", "stream"]))
        if op == "set":
            body[draw(st.sampled_from(_FIELDS) | st.text(max_size=8))] = draw(_JSON)
        elif op == "delete" and body:
            del body[draw(st.sampled_from(sorted(body)))]
        elif op == "message":
            body["messages"] = draw(st.lists(st.dictionaries(
                st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id", "x"]),
                _JSON | st.sampled_from(["user", "system", "assistant", "tool", "developer"]),
                max_size=4), max_size=3))
        else:
            body["stream"] = True
            body["stream_options"] = draw(_JSON | st.just({"include_usage": True}))
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] > 2:
        # A valid request must stay short; an invalid max_tokens is still tried above.
        body.setdefault("max_tokens", 1)
        if isinstance(body["max_tokens"], int) and not isinstance(body["max_tokens"], bool) \
                and body["max_tokens"] > 2:
            body["max_tokens"] = 2
    return _encode(body)


_EDGES = {
    "temperature": st.floats(0, 2) | st.floats(), "top_p": st.floats(0, 1),
    "seed": _INTS, "stream": st.booleans(), "user": st.text(max_size=50),
    "stop": st.lists(st.text(max_size=4), max_size=5) | st.text(max_size=4),
    "presence_penalty": st.floats(-2.5, 2.5), "frequency_penalty": st.floats(-2.5, 2.5),
    "max_tokens": st.integers(-3, 2), "logit_bias": st.dictionaries(st.text(max_size=6), _INTS),
    "n": st.integers(-1, 2),
}
_CONTENT = st.text(max_size=200) | st.sampled_from(["", "\ud800", "<|im_end|>", "<think>",
                                                    "\u0000" * 10, "\N{PILE OF POO}" * 30])


@st.composite
def _near_valid(draw: st.DrawFn, path: str) -> bytes:
    """Right types, edge values: many of these are valid and really generate."""
    body = copy.deepcopy(VALID[path])
    for key in draw(st.lists(st.sampled_from(sorted(_EDGES)), max_size=3, unique=True)):
        body[key] = draw(_EDGES[key])
    if path == CHAT:
        roles = st.sampled_from(["system", "user", "assistant", "developer", "tool"])
        body["messages"] = draw(st.lists(st.fixed_dictionaries({"role": roles,
                                                                "content": _CONTENT}),
                                         min_size=0, max_size=3))
    else:
        body["prompt"] = draw(_CONTENT | st.lists(st.integers(-1, 160_000), max_size=5))
    # ensure_ascii keeps lone surrogates as \ud800 escapes: valid JSON, invalid Unicode.
    return json.dumps(body, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")


_INVALID_UTF8 = [b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
                 b'{"model": "ti\xc3\x28ny", "prompt": "x", "max_tokens": 1}',
                 b'{"model": "tiny", "prompt": "\xed\xa0\x80", "max_tokens": 1}',
                 b"\xef\xbb\xbf" + _encode(VALID[COMPLETIONS])]  # a UTF-8 BOM
_BODIES = st.one_of(
    _near_valid(CHAT), _near_valid(COMPLETIONS),
    _mutated_valid(CHAT), _mutated_valid(COMPLETIONS),
    _JSON.map(_encode),
    st.binary(max_size=300),
    st.sampled_from(_INVALID_UTF8),
    st.builds(_deep, st.sampled_from([100, 1000, 100_000]), st.sampled_from(["list", "dict"])),
    st.sampled_from([b"", b"null", b"[]", b"{}", b'"x"', b"1e999", b"-0", b"{" * 3]),
)
_CONTENT_TYPES = st.sampled_from([None, "application/json", "application/json; charset=latin-1",
                                  "text/plain", "application/x-www-form-urlencoded",
                                  "multipart/form-data; boundary=x", "\x7f/\x7f"])


@given(path=st.sampled_from([CHAT, COMPLETIONS]), body=_BODIES, ctype=_CONTENT_TYPES)
@settings(max_examples=150, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def _fuzz_posts(port: int, tally: dict[str, int], path: str, body: bytes, ctype: str | None) -> None:
    headers = {"Content-Type": ctype} if ctype else {}
    outcome = assert_answer(*request(port, "POST", path, body, headers))
    tally[outcome] = tally.get(outcome, 0) + 1


@given(method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "POST"]),
       path=st.one_of(st.sampled_from([CHAT, COMPLETIONS, "/v1/models", "/health", "/metrics",
                                       "/v1/models/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
                                       "/v1/models/tiny", "/v1/models/" + "x" * 3000]),
                      st.text(max_size=30).map(lambda t: "/" + t.encode("utf-8", "surrogatepass")
                                               .hex())))
@settings(max_examples=40, deadline=None)
def _fuzz_routes(port: int, tally: dict[str, int], method: str, path: str) -> None:
    status, headers, data = request(port, method, path, b"{}" if method != "GET" else None)
    assert status < 500, (method, path, status)
    if status >= 400:
        assert_error_body(status, data)
    tally[f"route {status}"] = tally.get(f"route {status}", 0) + 1


async def test_fuzzed_requests_get_4xx_never_5xx_and_the_server_keeps_serving(container):
    async with running_server(container) as (engine, port):
        tally: dict[str, int] = {}
        await trio.to_thread.run_sync(lambda: _fuzz_posts(port, tally))
        await trio.to_thread.run_sync(lambda: _fuzz_routes(port, tally))
        print("outcomes:", tally)  # docs/reliability.md's table quotes these
        assert sum(v for k, v in tally.items() if k.startswith("4")) > 50, tally
        status, headers, data = await trio.to_thread.run_sync(
            lambda: request(port, "POST", CHAT, _encode({**VALID[CHAT], "max_tokens": 3}),
                            {"Content-Type": "application/json"}))
        assert status == 200 and json.loads(data)["usage"]["completion_tokens"] <= 3
        with trio.fail_after(30):
            while engine.busy:
                await trio.sleep(0.05)
        snapshot = engine.pool_snapshot()
        assert engine.waiting == 0 and snapshot["loads_in_flight"] == 0, snapshot
        assert snapshot["pinned"] == 0, snapshot


# -- security defaults -------------------------------------------------------------------------


def test_defaults_bind_loopback_only():
    assert ServerConfig().host == "127.0.0.1"
    # serve_engine without settings serves by ServerSettings(), the config's defaults.
    assert inspect.signature(serve_engine).parameters["settings"].default is None
    assert ServerSettings().host == "127.0.0.1"


def test_api_key_is_compared_in_constant_time():
    source = inspect.getsource(server_api.Api.check_auth)
    assert "hmac.compare_digest(" in source
    assert "== key" not in source and "key ==" not in source and "!= key" not in source


async def test_api_key_and_body_limit(container):
    async with running_server(container, api_key=KEY, max_body_bytes=2048) as (engine, port):
        body = _encode(VALID[COMPLETIONS])

        def post(headers: dict[str, str], data: bytes = body) -> tuple[int, bytes]:
            status, _h, out = request(port, "POST", COMPLETIONS, data,
                                      {"Content-Type": "application/json", **headers})
            return status, out

        def check() -> None:
            for auth in ["", "Bearer", "Bearer ", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x",
                         f"Bearer {KEY.upper()}", f"Basic {KEY}", KEY, f"Bearer {KEY[:-1]}\u00e9",
                         f"Token {KEY}"]:
                status, out = post({"Authorization": auth} if auth else {})
                assert status == 401, (auth, status)
                assert assert_error_body(status, out)["code"] == "invalid_api_key"
            status, out = post({"Authorization": f"Bearer {KEY}"})
            assert status == 200, out
            status, out = post({"Authorization": f"bearer  {KEY}"})  # scheme is case-free
            assert status == 200, out
            big = _encode({**VALID[COMPLETIONS], "prompt": "x" * 4000})
            status, out = post({"Authorization": f"Bearer {KEY}"}, big)
            assert status == 413 and "2048" in assert_error_body(status, out)["message"]
            # The limit holds before auth is looked at too: no unauthenticated memory sink.
            status, out = post({}, b"{" + b" " * 100_000 + b"}")
            assert status in (401, 413)

        await trio.to_thread.run_sync(check)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_binding_elsewhere_without_a_key_warns(container, fork_server):
    """`moestream serve --host 0.0.0.0` without --api-key logs server.open_without_key."""
    argv = ["--log-level", "info", "serve", str(container), "--host", "0.0.0.0",
            "--port", str(free_port()), "--slots", "16", "--prefill-chunk", "4"]
    proc = ForkedCLI(fork_server, argv)  # a process of its own, forked: no fresh imports
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "server.open_without_key" in line or "engine.open" in line:
                break
        text = "".join(seen)
        assert "server.open_without_key" in text and "0.0.0.0" in text, text[-2000:]
        assert "warn" in text.split("server.open_without_key")[0].splitlines()[-1].lower()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
