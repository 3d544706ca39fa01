"""Logs keep no user words: an exception logged at the default levels is its type name
only; at debug a plain traceback without the frames' local variables (they held the
prompt); the library's default set-up (no structlog configuration by the program) prints
info and above, to stderr, with the same rules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from pipeline.logging_setup import configure_logging

REPO = Path(__file__).resolve().parents[1]
SECRET = "my credit card is 4111-1111-1111-1111"


def _fail_with_the_prompt_in_a_local(prompt: str) -> None:
    tokens = prompt.split()  # a local holding the request's words
    raise RuntimeError(f"the engine failed after {len(tokens)} words")


@pytest.mark.parametrize("level, json", [("warning", False), ("info", True), ("debug", False),
                                         ("debug", True)])
def test_a_logged_failure_carries_no_request_text(level, json, capsys) -> None:
    configure_logging(level, json)
    try:
        try:
            _fail_with_the_prompt_in_a_local(SECRET)
        except RuntimeError as exc:
            structlog.get_logger("moestream.server").error("server.internal_error", exc_info=exc)
    finally:
        configure_logging("warning")
    err = capsys.readouterr().err
    assert "4111" not in err and "credit" not in err, err
    assert "server.internal_error" in err and "RuntimeError" in err, err
    if level == "debug":
        assert "Traceback" in err and "_fail_with_the_prompt_in_a_local" in err, err
    else:
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_the_library_default_logs_info_and_up_to_stderr_without_locals() -> None:
    code = (
        "import actors, structlog\n"  # importing the packages sets the default up
        "log = structlog.get_logger('t')\n"
        "log.debug('batch.regroup', rows=1)\n"
        "log.info('engine.open')\n"
        "def f(prompt):\n"
        "    words = prompt.split()\n"
        "    raise ValueError('no')\n"
        "try:\n"
        f"    f({SECRET!r})\n"
        "except ValueError as e:\n"
        "    log.error('server.internal_error', exc_info=e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert "engine.open" in done.stderr and "batch.regroup" not in done.stderr, done.stderr
    assert "4111" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "error_type=ValueError" in done.stderr, done.stderr


def test_the_cli_follows_the_config_log_section_unless_told_otherwise(tmp_path, capsys) -> None:
    from pipeline.cli import main

    config = tmp_path / "c.toml"
    config.write_text(f'[model]\npath = "{tmp_path}/m.qpack"\nsource = "{tmp_path}/no-src"\n'
                      '[log]\nlevel = "info"\n')
    try:
        assert main(["run", str(config)]) == 2
        assert "prepare.pack" in capsys.readouterr().err  # an info line: [log] level applied
        assert main(["--log-level", "warning", "run", str(config)]) == 2
        assert "prepare.pack" not in capsys.readouterr().err  # the flag wins
    finally:
        configure_logging("warning")
