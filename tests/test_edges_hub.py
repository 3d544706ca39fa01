"""`moestream pack <repo id>` against hubs that fail: bounded waits, retries, one clear line.

A local socket that accepts connections and never answers stands for a stuck hub; a
`.invalid` host name (RFC 6761: never resolves) for a DNS failure.
"""

from __future__ import annotations

import socket
import threading

import pytest

from pipeline.cli import main


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost,.invalid")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("MOESTREAM_HUB_TIMEOUT_S", "0.5")
    monkeypatch.setenv("MOESTREAM_HUB_ATTEMPTS", "3")
    monkeypatch.setenv("MOESTREAM_HUB_BACKOFF_S", "0.05")
    return tmp_path


class SilentServer:
    """Accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


def test_a_hub_that_never_answers_times_out_retries_and_names_repo_and_endpoint(hub_env, monkeypatch, capsys):
    server = SilentServer()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    try:
        # No clock: the attempts counted and the message's timeout say it gave up in time.
        status = main(["pack", "acme/stuck-model", "-o", str(hub_env / "x.qpack")])
    finally:
        server.close()
    err = capsys.readouterr().err
    assert status == 2
    assert len(server.accepted) >= 3, "retried"
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert f"{server.url}/acme/stuck-model" in lines[0] and "no answer within 0.5 s" in lines[0], lines[0]
    assert "after 3 attempts" in lines[0]
    assert "hub: asking" in err  # something is shown while waiting
    assert "Traceback" not in err


def test_a_dns_failure_is_one_line_naming_the_endpoint(hub_env, monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", "http://hub.moestream-test.invalid")
    monkeypatch.setenv("MOESTREAM_HUB_ATTEMPTS", "2")
    status = main(["pack", "acme/model", "-o", str(hub_env / "y.qpack"), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and len(err.strip().splitlines()) <= 3, err
    assert "http://hub.moestream-test.invalid/acme/model" in lines[0]
    assert "cannot connect" in lines[0] and "after 2 attempts" in lines[0], lines[0]
    assert "Traceback" not in err
