"""`moestream launch -n N -- COMMAND`: run a distributed job's ranks on this machine.

The way to run a distributed server under a service manager (docs/distributed.md): it
stops the job through this process's PID, and this process forwards the signal to the
ranks and waits for them.
"""

from __future__ import annotations

import argparse

from pipeline.failures import refused


def _cmd_launch(args: argparse.Namespace) -> int:
    from pipeline.distributed.launch import launch

    command = args.rank_command[1:] if args.rank_command[:1] == ["--"] else args.rank_command
    if args.ranks < 1:
        return refused(ValueError(f"-n: a job needs at least one rank, not {args.ranks}"))
    if not command:
        return refused(ValueError("launch: no command for the ranks (moestream launch -n 2 "
                                  "-- moestream serve MODEL --distributed)"))
    if args.kill_after <= 0:
        return refused(ValueError(f"--kill-after: must be positive, not {args.kill_after:g}"))
    return launch(args.ranks, command, args.kill_after)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="run the ranks of a distributed job on this machine (under a service "
        "manager, in a container)",
        description="Start COMMAND N times as the ranks of one distributed job on this "
        "machine (ring backend over loopback, as `mlx.launch -n N --backend ring`), "
        "forward SIGTERM and SIGINT to them and wait for them; exit with the first failing "
        "rank's status. Ranks whose launcher dies (even by SIGKILL) stop by themselves. "
        "Example: moestream launch -n 2 -- moestream serve q.qpack --distributed")
    p.add_argument("-n", "--ranks", type=int, required=True, help="ranks to start")
    p.add_argument("--kill-after", type=float, default=30.0, metavar="SECONDS",
                   help="SIGKILL what is left of the job this long after a SIGTERM or a "
                   "failed rank (default 30)")
    # Not `command`: the subcommand's own name is kept under that name (pipeline/cli).
    p.add_argument("rank_command", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the command every rank runs, after --")
    p.set_defaults(func=_cmd_launch)
