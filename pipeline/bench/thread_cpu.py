"""CPU seconds per thread over a case's decode (`moestream bench`, Linux).

The fast disk's cap has been the host's work, not the disk (docs/results.md): the event
loop's per-read and per-layer bookkeeping, the MLX thread's graph building and syncs,
and the disk and staging threads' Python around their preadv and copies, all under one
GIL. Each thread's CPU time over the decode window says which of them is busy: a thread
near the wall time (or Python threads whose sum is) is the cap, and a sum well below it
says the time goes to waiting. Grouped by the thread's name without its number
("moestream-read" for every disk thread); threads Python did not start (CUDA's, MLX's
own) are "native". Read from /proc/self/task/*/stat (utime + stime); empty elsewhere.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

_TASKS = Path("/proc/self/task")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_NUMBER = re.compile(r"[-_ ]?\(?\d+\)?$")


def group_of(name: str) -> str:
    """A thread's name without its trailing number: one row per kind of thread."""
    return _NUMBER.sub("", name) or name


def sample() -> dict[int, tuple[str, float]]:
    """Every thread of this process now: native id -> (group, CPU seconds so far)."""
    if not _TASKS.is_dir():
        return {}
    names = {t.native_id: group_of(t.name) for t in threading.enumerate() if t.native_id is not None}
    out: dict[int, tuple[str, float]] = {}
    for task in _TASKS.iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended between the listing and the read
            continue
        # Fields after the command's closing parenthesis (the name may hold spaces):
        # state is field 3, utime and stime fields 14 and 15.
        fields = stat[stat.rindex(")") + 2:].split()
        tid = int(task.name)
        out[tid] = (names.get(tid, "native"), (int(fields[11]) + int(fields[12])) * _TICK_S)
    return out


def between(start: dict[int, tuple[str, float]], end: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each group of threads spent from `start` to `end` (threads that began
    in between count from zero; those that ended are lost), largest first."""
    spent: dict[str, float] = {}
    for tid, (group, cpu) in end.items():
        before = start.get(tid, (group, 0.0))[1]
        spent[group] = spent.get(group, 0.0) + max(cpu - before, 0.0)
    return {g: round(s, 3) for g, s in sorted(spent.items(), key=lambda kv: -kv[1]) if s > 0}
