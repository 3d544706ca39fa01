"""Memory pressure: the pool shrinks while the machine is short of memory, then grows back.

`memory.adapt = true`. One function says how pressed the machine is (`read_pressure`):
Linux's pressure-stall information (/proc/pressure/memory: the share of the last 10 s in
which some or all tasks waited for memory), or macOS's memory-pressure level
(`kern.memorystatus_vm_pressure_level`: 1 normal, 2 warn, 4 critical; not testable on
the Linux VMs this was written on). The adapter polls it; while pressed, each poll
withdraws an eighth of the pool's slots (never below the smallest workable pool) and
hands their memory back to the OS; after `CALM_POLLS` calm polls it restores an eighth.

No request fails for it: slots are withdrawn only during the adapter's compute turn
(no forward pass in flight), and only slots that are free or hold a ready, unpinned
expert, which is then read again on its next use, as any evicted one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec
import structlog
import trio

if TYPE_CHECKING:
    from pipeline.engine_core import EngineCore

log = structlog.get_logger("moestream.memory")

PSI = Path("/proc/pressure/memory")
Level = Literal["calm", "pressed"]
SOME_PRESSED = 10.0  # % of the last 10 s some task stalled on memory
FULL_PRESSED = 2.0  # % of it every task did
STEP = 1 / 8  # of the pool's slots, per poll
CALM_POLLS = 5  # calm readings in a row before the pool grows back
POLL_S = 1.0


class Pressure(msgspec.Struct, frozen=True):
    level: Level
    source: str  # "psi" or "macos"
    some_avg10: float = 0.0
    full_avg10: float = 0.0


def parse_psi(text: str) -> Pressure:
    """/proc/pressure/memory's two lines: `some avg10=.. avg60=.. avg300=.. total=..`, `full ...`."""
    avg = {"some": 0.0, "full": 0.0}
    for line in text.splitlines():
        kind, *fields = line.split()
        values = dict(f.split("=", 1) for f in fields if "=" in f)
        if kind in avg and "avg10" in values:
            avg[kind] = float(values["avg10"])
    pressed = avg["some"] >= SOME_PRESSED or avg["full"] >= FULL_PRESSED
    return Pressure("pressed" if pressed else "calm", "psi", avg["some"], avg["full"])


def _macos_level() -> int | None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    value, size = ctypes.c_int(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_int))
    name = b"kern.memorystatus_vm_pressure_level"
    if libc.sysctlbyname(name, ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
        return None
    return value.value


def read_pressure(psi: Path = PSI) -> Pressure | None:
    """How pressed this machine's memory is now; None where the OS does not say."""
    if sys.platform == "darwin":
        level = _macos_level()
        return None if level is None else Pressure("pressed" if level >= 2 else "calm", "macos")
    try:
        return parse_psi(psi.read_text())
    except OSError:  # no PSI (kernel without CONFIG_PSI, or a container hiding it)
        return None


class PoolAdapter:
    """Shrinks and regrows the engine's pool with the pressure `read` reports."""

    def __init__(self, engine: EngineCore, floor_slots: int,
                 read: Callable[[], Pressure | None] = read_pressure) -> None:
        self.engine = engine
        self.read = read
        # `floor_slots` in every bank (a layer's keys take slots in their own bank only).
        self.keep = floor_slots
        banks = engine.router.table.banks
        self.floor = floor_slots * (len(banks.ranges) if banks is not None else 1)
        self.step = max(1, int(engine.router.table.num_slots * STEP))
        self.calm = 0
        self.released_bytes = 0

    async def poll(self) -> Pressure | None:
        """One reading, and the pool's answer to it."""
        reading = self.read()
        if reading is None:
            return None
        table = self.engine.router.table
        if reading.level == "pressed":
            self.calm = 0
            count = min(self.step, table.usable - self.floor)
            if count > 0:
                async with self.engine.batch.exclusive():  # no forward reads a slot now
                    slots = table.withdraw(count, keep=self.keep)
                    freed = await self.engine.worker.run(self.engine.storage.release, slots)
                self.released_bytes += freed
                log.info("memory.pool_shrunk", slots=len(slots), usable=table.usable,
                         released_mb=round(freed / 2**20, 1), some_avg10=reading.some_avg10,
                         full_avg10=reading.full_avg10)
        else:
            self.calm += 1
            if self.calm >= CALM_POLLS and table.usable < table.num_slots:
                back = table.restore(self.step)
                self.calm = 0
                log.info("memory.pool_regrown", slots=len(back), usable=table.usable)
        return reading

    async def run(self) -> None:
        """Poll until cancelled (the engine's nursery); stops if the OS never says."""
        if self.read() is None:
            log.info("memory.adapt_unavailable", reason="no memory-pressure source on this OS")
            return
        while True:
            await trio.sleep(POLL_S)
            await self.poll()
