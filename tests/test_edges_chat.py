"""Interactive `moestream chat` as a user drives it: empty lines, Ctrl-C mid-reply, Ctrl-C
at the prompt. A real process on pipes; SIGINT is what a terminal sends for Ctrl-C."""

from __future__ import annotations

import os
import signal
import threading
import time
from multiprocessing.context import BaseContext
from pathlib import Path

import pytest
from forked_cli import ForkedCLI
from helpers_server import own_copy

PROMPT = ">>> "


@pytest.fixture(scope="module")
def tiny(synth_checkpoint, packed, tmp_path_factory) -> Path:
    return own_copy(packed(synth_checkpoint("qwen3_next"), bits=None), tmp_path_factory, "edges-chat")


class Session:
    def __init__(self, ctx: BaseContext, model: Path) -> None:
        # A process of its own on pipes, forked from the fork server (no fresh imports).
        self.proc = ForkedCLI(ctx, ["chat", str(model), "--slots", "16", "--prefill-chunk",
                                    "4", "--max-tokens", "150", "--temperature", "0"], pipes=True)
        self.out = ""
        self.err = ""
        for name in ("out", "err"):
            threading.Thread(target=self._pump, args=(name,), daemon=True).start()

    def _pump(self, name: str) -> None:
        stream = self.proc.stdout if name == "out" else self.proc.stderr
        assert stream is not None
        while chunk := os.read(stream.fileno(), 4096):
            setattr(self, name, getattr(self, name) + chunk.decode(errors="replace"))

    def wait(self, predicate, what: str, timeout: float = 120) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while not predicate():
            assert self.proc.poll() is None or predicate(), f"exited waiting for {what}: {self.err[-3000:]}"
            assert time.monotonic() < deadline, f"no {what}: out={self.out[-500:]!r} err={self.err[-2000:]}"
            time.sleep(0.02)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()


def test_ctrl_c_stops_the_reply_keeps_the_session_and_exits_quietly_at_the_prompt(tiny, fork_server):
    s = Session(fork_server, tiny)
    try:
        s.wait(lambda: s.out.count(PROMPT) == 1, "the first prompt")
        assert "loading " in s.err and "loaded tiny in" in s.err  # said while the model loads
        assert "Ctrl-D or /exit leaves" in s.err  # how to leave, said before the first prompt
        s.send("")  # an empty line is not a turn
        s.wait(lambda: s.out.count(PROMPT) == 2, "a new prompt after the empty line")
        s.send("Tell me a long story")
        start = len(s.out)
        s.wait(lambda: len(s.out) > start + 20, "reply text")
        s.proc.send_signal(signal.SIGINT)  # Ctrl-C mid-reply
        s.wait(lambda: "reply interrupted" in s.err and s.out.count(PROMPT) == 3, "back at the prompt")
        assert s.proc.poll() is None, "the session survived"
        assert "tok/s" not in s.err  # no turn finished so far: the empty line sent nothing

        s.send("And then?")  # the session goes on
        s.wait(lambda: "tok/s" in s.err and s.out.count(PROMPT) == 4, "a whole second reply", 300)
        assert s.err.count("tok/s") == 1

        s.proc.send_signal(signal.SIGINT)  # Ctrl-C at the idle prompt: leave, no Enter needed
        assert s.proc.wait(30) == 0, s.err[-3000:]
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
        s.proc.wait(30)
    assert "Traceback" not in s.err and "KeyboardInterrupt" not in s.err, s.err[-3000:]
