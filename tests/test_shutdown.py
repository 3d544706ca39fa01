"""`moestream serve` as a process of its own: SIGTERM during a streaming generation.

The stream in flight must end cleanly (every byte received is a whole SSE event of
valid JSON, nothing half-written), the process must exit 0, and it must bind only
loopback by default.
"""

from __future__ import annotations

import http.client
import json
import queue
import signal
import socket
import threading
import time
from multiprocessing.context import BaseContext
from pathlib import Path

import pytest
from forked_cli import ForkedCLI

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`moestream serve` in a process of its own (forked, tests/forked_cli.py), its output
    collected line by line."""

    def __init__(self, ctx: BaseContext, container: Path, *flags: str,
                 permissions: bool = False) -> None:
        self.port = free_port()
        argv = ["--log-level", "info", "serve", str(container), "--port", str(self.port),
                "--slots", "16", "--prefill-chunk", "4", *flags]
        self.proc = ForkedCLI(ctx, argv, permissions=permissions)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, event: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, "".join(self.log)[-3000:]
                continue
            self.log.append(line)
            if event in line:
                return line
        raise AssertionError(f"no {event} within {timeout} s: {''.join(self.log)[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def eos_of(container: Path) -> list[int]:
    """The ids that would end a long answer early (the tiny models' small vocabulary lets
    greedy decoding meet one within a few hundred tokens): banned where it must run on."""
    from pipeline.generation_config import eos_token_ids

    return eos_token_ids(container) or []


def stream(port: int, max_tokens: int, banned: list[int] | None = None, n: int = 1,
           ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}],
            "max_tokens": max_tokens, "stream": True, "n": n,
            "logit_bias": {str(t): -100.0 for t in banned or ()}}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def read_events(resp: http.client.HTTPResponse, count: int | None = None) -> list[str]:
    """SSE data payloads until `count` of them or the end of the stream; checks framing."""
    events: list[str] = []
    while count is None or len(events) < count:
        line = resp.readline()
        if not line:
            break
        assert line.endswith(b"\n"), f"truncated SSE line {line!r}"
        text = line.decode().rstrip("\n")
        if text.startswith("data: "):
            events.append(text[6:])
        else:
            assert text == "", f"not SSE: {text!r}"
    return events


def check_events(events: list[str]) -> None:
    """Whole JSON chunks; the last may be the error event a shutdown ends a reply with."""
    for i, event in enumerate(events):
        if event != "[DONE]":
            chunk = json.loads(event)  # whole JSON, never cut
            if "error" in chunk and i == len(events) - 1:
                assert chunk["error"]["code"] == "server_shutting_down", chunk
                continue
            assert chunk["object"] == "chat.completion.chunk", chunk


def non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))  # no packet is sent for UDP connect
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_sigterm_mid_stream_ends_the_stream_cleanly_and_exits_0(fork_server, container):
    # A 30 s grace: the short answer below must finish within it however slowly a loaded
    # machine lets the server decode (the default 5 s left it 3.5 s after the SIGTERM);
    # the drain ends with the answer, not with the grace.
    server = Server(fork_server, container, "--set", "server.shutdown_grace_s=30")
    try:
        listening = server.wait_for("server.listening")
        assert "host=127.0.0.1" in listening, listening  # loopback unless told otherwise
        address = non_loopback_address()
        if address is not None:  # nothing answers on the machine's other addresses
            with pytest.raises(OSError), socket.create_connection((address, server.port), 2):
                pass

        # A short answer in flight at SIGTERM finishes within the graceful period, every
        # choice of it (they are read one after the other: the second was taken for a reply
        # not yet producing, and cut).
        conn, resp = stream(server.port, 12, n=2)
        first = read_events(resp, 2)
        server.proc.send_signal(signal.SIGTERM)
        rest = read_events(resp)
        conn.close()
        events = first + rest
        check_events(events)
        assert events[-1] == "[DONE]", events[-3:]
        finished = {c["index"]: c["finish_reason"] for e in events[:-1]
                    for c in json.loads(e)["choices"] if c["finish_reason"]}
        assert set(finished) == {0, 1} and set(finished.values()) <= {"length", "stop"}, finished
        assert server.proc.wait(60) == 0, "".join(server.log)[-3000:]
    finally:
        server.stop()
    rest_of_log = server.log + list(server.lines.queue)
    assert any("server.shutdown" in line and "SIGTERM" in line for line in rest_of_log), \
        "".join(rest_of_log)[-2000:]
    assert not any("Traceback" in line for line in rest_of_log), "".join(rest_of_log)[-3000:]


def test_sigterm_during_a_long_generation_cuts_it_at_an_event_boundary(fork_server, container):
    """Longer than the graceful period (`server.shutdown_grace_s`, 1 s here): cancelled,
    but only whole events reach the client."""
    server = Server(fork_server, container, "--set", "server.shutdown_grace_s=1")
    try:
        server.wait_for("server.listening")
        conn, resp = stream(server.port, 3000, eos_of(container))
        first = read_events(resp, 3)
        server.proc.send_signal(signal.SIGTERM)
        try:
            rest = read_events(resp)
        except http.client.IncompleteRead as exc:  # a chunked body cut between chunks
            pytest.fail(f"stream cut inside a chunk: {exc!r}")
        conn.close()
        check_events(first + rest)
        assert "[DONE]" not in rest, "3000 tokens finished within the grace period: not cut"
        # Cut after the grace period, and told so: the stream ends with one error event.
        assert json.loads(rest[-1])["error"]["code"] == "server_shutting_down", rest[-3:]
        assert server.proc.wait(60) == 0, "".join(server.log)[-3000:]
        # Refused once down: nothing lingers on the port.
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", server.port), 2).close()
    finally:
        server.stop()
    log = server.log + list(server.lines.queue)
    assert not any("Traceback" in line for line in log), "".join(log)[-3000:]
