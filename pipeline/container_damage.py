"""A container that goes bad under a running engine: which expert, what damage, what to do.

An expert read that fails for good (`ExpertReadError`, after the reader's retries)
carries its (layer, expert), and its cause chain holds the last attempt's error: a crc32
mismatch, a short read, a file that is gone or unreadable, a disk error. `explain` turns
it into `ContainerDamaged`, whose message is the one line a user sees, naming the damage
and the fix (`expert 3 of layer 2 failed its checksum: the container is damaged; run
moestream verify C`): the server's JSON error or stream error event, the CLI's `error:`
line. Generations end through one place (`Generation.run`), which calls it.

Each damage is also recorded per container (`damage_log`), so that `/health` names the
damaged files from then on: a flipped byte changes no size, so the health check's stats
alone would keep saying "ok". A record is dropped only when its file has changed since
(size, times, mode, inode) and the expert now reads clean (restored, chmod back).

Requests that do not need a damaged expert go on: damage is per expert (its crc32 is
checked on first use), the rest of the container still serves them, and refusing every
request would turn one bad expert into an outage. /health turning 503 is what tells a
load balancer to send traffic elsewhere.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog

from actors.reader import ExpertReadError
from qpack import spec
from qpack.checked_files import expert_problem
from qpack.reader import Container, ExpertCorrupt
from qpack.spec import QpackError

log = structlog.get_logger("moestream.damage")
MAX_RECORDS = 256  # damaged experts remembered per container (bounded; more are counted)
_FIX = "the container is damaged; run moestream verify {root}"


@dataclass(frozen=True)
class _Kind:
    name: str
    cause: type[BaseException]  # the failed attempt's error
    what: str  # after "expert E of layer L"; {file} and {reason} filled in
    fix: str


# First match wins: ExpertCorrupt is a QpackError, PermissionError an OSError. The only
# QpackError a read raises besides the crc32 is the short read.
KINDS = (
    _Kind("checksum", ExpertCorrupt, "failed its checksum", _FIX),
    _Kind("truncated", QpackError, "is cut short: {file} ends before it (truncated?)", _FIX),
    _Kind("missing", FileNotFoundError, "cannot be read: {file} is missing", _FIX),
    _Kind("unreadable", PermissionError, "cannot be read: {file}: permission denied",
          "make the file readable by this process, then run moestream verify {root}"),
    _Kind("disk", OSError, "cannot be read from {file}: {reason}",
          "the disk or the container is failing; run moestream verify {root}"),
)


class Damage(msgspec.Struct, frozen=True):
    layer: int
    expert: int
    kind: str  # a KINDS name
    file: str
    what: str  # "expert E of layer L failed its checksum": what /health lists
    message: str  # the user's one line: what, then the fix
    detail: str  # the read's own error (crc values, errno): for the log


class ContainerDamaged(ExpertReadError):
    """A generation needed an expert the container cannot give: the message says which,
    why and what to do."""

    def __init__(self, damage: Damage) -> None:
        super().__init__(damage.message, (damage.layer, damage.expert))
        self.damage = damage


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _deepest_cause(exc: BaseException) -> BaseException:
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def find_damaged(exc: BaseException) -> ContainerDamaged | None:
    """The ContainerDamaged in `exc` (itself or inside trio's exception groups)."""
    return next((e for e in _leaves(exc) if isinstance(e, ContainerDamaged)), None)


def explain(exc: BaseException, container: Container) -> BaseException:
    """`exc` as ContainerDamaged when an expert read failed for good with a known kind of
    damage (recorded in the container's damage log); otherwise `exc` itself."""
    if (done := find_damaged(exc)) is not None:
        return done
    failed = next((e for e in _leaves(exc) if isinstance(e, ExpertReadError) and e.key), None)
    if failed is None or failed.key is None:
        return exc
    cause = _deepest_cause(failed)
    kind = next((k for k in KINDS if isinstance(cause, k.cause)), None)
    if kind is None:
        return exc
    layer, expert = failed.key
    path = container.root / container.manifest.layer(layer).file
    reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
    head = container.manifest.mtp_experts  # its experts are "layer num_layers" of none
    where = "the MTP head" if head is not None and layer == head.index else f"layer {layer}"
    what = f"expert {expert} of {where} " + kind.what.format(file=path, reason=reason)
    damage = Damage(layer, expert, kind.name, str(path), what,
                    f"{what}: {kind.fix.format(root=container.root)}", str(cause))
    damage_log(container).record(damage)
    log.warning("container.damaged", layer=layer, expert=expert, kind=kind.name,
                file=str(path), detail=damage.detail)
    damaged = ContainerDamaged(damage)
    damaged.__cause__ = exc
    return damaged


_Stamp = tuple[int, int, int, int, int] | None


def _stamp(path: str) -> _Stamp:
    """What changes when a file is restored, replaced, rewritten or chmod-ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


class DamageLog:
    """The damaged experts of one container, as reads found them (thread-safe: recorded
    on the trio thread, re-examined by the health check in a worker thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[tuple[int, int], tuple[Damage, _Stamp]] = {}
        self.dropped = 0  # damaged experts past MAX_RECORDS (still reported as a count)

    def record(self, damage: Damage) -> None:
        key = (damage.layer, damage.expert)
        with self._lock:
            if key in self._records or len(self._records) < MAX_RECORDS:
                self._records[key] = (damage, _stamp(damage.file))
            else:
                self.dropped += 1

    def __len__(self) -> int:
        return len(self._records)

    def problems(self, root: Path, manifest: spec.Manifest,
                 examine: Callable[..., str | None] = expert_problem) -> list[str]:
        """One line per damaged expert (blocking: run it in a thread). An expert whose
        file changed since it was recorded is read again and forgotten if it is clean."""
        with self._lock:
            records = list(self._records.items())
        out = []
        for key, (damage, stamp) in records:
            now = _stamp(damage.file)
            if now != stamp:
                clean = examine(root, manifest, damage.layer, damage.expert) is None
                with self._lock:
                    if self._records.get(key) == (damage, stamp):  # not recorded anew meanwhile
                        if clean:
                            del self._records[key]
                        else:  # still damaged: not read again until the file changes again
                            self._records[key] = (damage, now)
                if clean:
                    log.info("container.damage_gone", layer=damage.layer, expert=damage.expert,
                             file=damage.file)
                    continue
            out.append(f"{damage.file}: {damage.what}")
        if self.dropped:
            out.append(f"and {self.dropped} more damaged experts")
        return out


_LOGS: weakref.WeakKeyDictionary[Container, DamageLog] = weakref.WeakKeyDictionary()


def damage_log(container: Container) -> DamageLog:
    """The container's damage log (kept beside it, as long as the container lives)."""
    found = _LOGS.get(container)
    if found is None:
        found = _LOGS[container] = DamageLog()
    return found
