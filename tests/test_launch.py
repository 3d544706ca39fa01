"""A distributed job stops with its launcher, however the launcher goes.

Real processes and real signals: a launcher (`moestream launch`, pipeline/distributed/
launch.py) of two ranks serving the tiny container on the ring backend over loopback
(tests/forked_launch.py), stopped the way service managers stop things; and the
launcher watch of a rank (pipeline/distributed/launcher_watch.py) in plain processes.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from forked_launch import Launched, alive
from test_shutdown import check_events, eos_of, read_events, stream

from pipeline.cli import main
from pipeline.distributed.launcher_watch import available_watches
from pipeline.server.serve import check_bindable

REPO = Path(__file__).resolve().parents[1]
GONE_S = 10  # what the issue allows the whole job to take to be gone
# Far more tokens than any machine decodes within a 15-30 s grace (two CPU ranks on a ring
# here: some 150 a second), so it is the grace's cut that ends such a reply.
LONG = 100_000


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


# -- the watch, in plain processes -----------------------------------------------------------

# A rank's stand-in: arms the watch, says so, and once the SIGTERM it brings has come
# (outside the handler, as trio does) writes to the stdout and stderr it shares with its
# dead launcher, as a draining server logs.
RANK = """
import signal, sys, time
from pipeline.distributed.launcher_watch import watch_launcher
told = []
signal.signal(signal.SIGTERM, lambda signum, frame: told.append(signum))
print(watch_launcher(how=sys.argv[1]), flush=True)
while not told:
    time.sleep(0.02)
for _ in range(100):
    print("draining", flush=True)
    print("still draining", file=sys.stderr, flush=True)
with open(sys.argv[2], "w") as f:
    f.write("stopped")
"""

# The launcher's stand-in: starts the rank with its output in pipes only it reads.
LAUNCHER = """
import subprocess, sys
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
print(rank.pid, rank.stdout.readline().decode().strip(), flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("how", available_watches())
def test_a_rank_stops_when_its_launcher_is_killed(how: str, tmp_path: Path) -> None:
    done = tmp_path / "done"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK, how, str(done)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env={"PYTHONPATH": str(REPO)})
    try:
        pid, armed = launcher.stdout.readline().decode().split()
        assert armed == how
        launcher.kill()  # SIGKILL: nothing of the launcher's runs
        launcher.wait(10)
        deadline = time.monotonic() + GONE_S
        while alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(int(pid)), f"the rank outlived its launcher ({how})"
        # Its output had no reader any more: the writes went to /dev/null, not to EPIPE.
        assert done.read_text() == "stopped"
    finally:
        launcher.kill()


# -- the launcher command --------------------------------------------------------------------


def _launch(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "--log-level", "info", "launch",
                           *argv], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_launch_refuses_in_one_line_and_stops_the_job_when_a_rank_fails(capsys) -> None:
    # Refused before any rank runs: safe in this process (the launcher reaps any child).
    for argv, status, words in ((["-n", "0", "--", "true"], 2, "at least one rank"),
                                (["-n", "2"], 2, "no command for the ranks"),
                                (["-n", "2", "--", "/no/such/rank"], 1, "cannot start rank 0")):
        assert main(["launch", *argv]) == status
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in err, err
    # Rank 1 fails: the others (asleep for a minute) are stopped at once, the hostfile
    # removed; the job's status is the failure's.
    rank = ('test -f "$MLX_HOSTFILE" && [ "$MOESTREAM_LAUNCHER_PID" = "$PPID" ] || exit 9; '
            '[ "$MLX_RANK" = 1 ] && exit 3; exec sleep 60')
    done = _launch("-n", "3", "--", "sh", "-c", rank)
    assert done.returncode == 3, done.stderr
    assert "launch.rank_failed" in done.stderr and "rank=1 status=3" in done.stderr
    assert done.stderr.count("status=143") == 2  # rank 0 and 2: SIGTERM, not the minute
    hostfile = re.search(r"hostfile=(\S+)", done.stderr)[1]
    assert not Path(hostfile).exists()


def test_launch_forwards_a_sigint_no_terminal_delivered() -> None:
    # `kill -INT <launcher>` (no terminal: its Ctrl-C would have reached the ranks itself).
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "--log-level", "info",
                             "launch", "-n", "2", "--", "sh", "-c", "exec sleep 60"],
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "launch.started" in line:
                break
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 128 + signal.SIGINT  # both sleeps died of it, not the minute
    finally:
        proc.kill()


# -- a serving job, stopped the way service managers stop things -----------------------------


def _job(fork_server, container: Path, grace_s: float, max_tokens: int = 8192,
         ) -> tuple[Launched, int]:
    """A two-rank serving job; a reply still running at shutdown decodes for `grace_s`. Its
    port is any free one, read from `server.listening` (a port chosen here and bound later
    could be taken in between, by the other test worker or a connection's source port)."""
    argv = ["--log-level", "info", "serve", str(container), "--distributed", "--port", "0",
            "--slots", "8", "--prefill-chunk", "2", "--set", f"server.shutdown_grace_s={grace_s}",
            "--set", f"server.max_tokens_limit={max_tokens}"]
    job = Launched(fork_server, 2, argv)
    listening = job.wait_for("server.listening", 120)
    return job, int(re.search(r"port=(\d+)", listening)[1])


def _post_status(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}),
                     {"Content-Type": "application/json"})
        return conn.getresponse().status
    finally:
        conn.close()


def test_sigkill_to_the_launcher_stops_every_rank(fork_server, container) -> None:
    # Nothing of the launcher runs: each rank's watch sees it gone and SIGTERMs its own
    # rank, and rank 0 drains as on any SIGTERM. The reply this test streams holds the
    # drain open (LONG tokens to go, a 15 s grace), so the 503 probe and the chunks after
    # it land in the drain however late a loaded machine lets the test send and read them
    # (a 3 s grace once ended first: connection refused; the probe and six chunks take well
    # under a second). Then the test hangs up, which ends the reply and with it the drain:
    # a reply cut at the grace's end is test_shutdown.py's (waiting for it here held one
    # of CI's two workers for the whole grace).
    job, port = _job(fork_server, container, 15, max_tokens=LONG)
    try:
        conn, resp = stream(port, LONG, eos_of(container))
        first = read_events(resp, 3)
        job.proc.kill()  # SIGKILL
        job.wait_for("server.shutdown", GONE_S)  # rank 0 has begun to drain
        assert _post_status(port) == 503
        more = read_events(resp, 3)  # the ranks decode on without their launcher
        assert [json.loads(e)["object"] for e in more] == ["chat.completion.chunk"] * 3, more
        conn.close()  # the reply ends, the drain with it
        check_events(first + more)
        assert job.gone_within(GONE_S), job.output()[-4000:]
        check_bindable("127.0.0.1", port)  # raises PortInUse if anything still holds it
        log = job.output()
        assert "distributed.stage_done" in log and "Traceback" not in log, log[-4000:]
        assert log.count("distributed.launcher_gone") == 2, log[-4000:]  # each rank saw it
        assert "server.drained" in log, log[-4000:]  # rank 0's drain ran to its end
        assert not Path(re.search(r"hostfile=(\S+)", log)[1]).exists()  # the ranks removed it
    finally:
        job.kill()


def test_sigterm_to_the_launcher_is_forwarded_and_waited_for(fork_server, container) -> None:
    # As a service manager that signals the launcher and then its group: a second SIGTERM
    # while rank 0 drains must not cut the drain short. The drain is held open by a reply
    # this test streams (a 30 s grace, thousands of tokens to go) until the test lets it
    # go, so the second SIGTERM lands in it however late a loaded machine lets the test
    # send it (a 3 s grace once ended first: rank 0 was gone, the SIGTERM too late).
    job, port = _job(fork_server, container, 30)
    try:
        conn, resp = stream(port, 8000, eos_of(container))
        first = read_events(resp, 3)
        job.proc.terminate()
        job.wait_for("server.shutdown", GONE_S)  # rank 0 took it (signals together count once)
        job.proc.terminate()
        job.wait_for("server.shutdown_repeated", GONE_S)  # absorbed by rank 0, still draining
        assert _post_status(port) == 503
        more = read_events(resp, 3)  # the reply goes on: nothing was cut
        check_events(first + more)
        assert [json.loads(e)["object"] for e in more] == ["chat.completion.chunk"] * 3, more
        conn.close()  # the reply ends (its client is gone), and with it the drain
        assert job.gone_within(GONE_S), job.output()[-4000:]
        assert job.proc.exitcode == 0, job.output()[-4000:]  # the ranks drained and ended 0
        check_bindable("127.0.0.1", port)  # raises PortInUse if anything still holds it
        log = job.output()
        assert "distributed.stage_done" in log and "Traceback" not in log, log[-4000:]
        # The second SIGTERM came while rank 0 drained, and the drain ran to its end: no
        # reply left unfinished (none was cut at the grace either).
        assert re.search(r"server\.drained\s+unfinished=0", log), log[-4000:]
        assert log.index("server.shutdown_repeated") < log.index("server.drained"), log[-4000:]
        assert log.count("launch.rank_done") == 2, log[-4000:]
    finally:
        job.kill()
