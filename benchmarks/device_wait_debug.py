"""Watch a decode with the device wait (actors/device_wait.py): every few seconds the
mailboxes' published / answered sequence numbers and the abort word, and after `--dump`
seconds every thread's stack (then exit). For a run that stalls.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/device_wait_debug.py C [--slots 64] [--tokens 8]
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio  # noqa: E402

from actors.sampling_params import SamplingParams  # noqa: E402
from pipeline.config.loading import config_from_dict  # noqa: E402
from pipeline.engine import open_engine  # noqa: E402
from pipeline.events import Done  # noqa: E402


def watch(core: Any, every: float) -> None:
    while True:
        time.sleep(every)
        wait = core.compute.device_wait
        if wait is None:
            print("watch: no device wait", flush=True)
            return
        box, words = wait.box, 8192
        rows = [(int(box[(r + 1) * words]), int(box[(r + 1) * words + 1])) for r in range(wait.rows)]
        print(f"watch {time.strftime('%T')}: abort {box[0]} timeouts {box[1]} seq {wait._seq} "
              f"awaited {core.compute.stats.awaited_tokens} rows {rows[:6]}...{rows[-2:]} "
              f"loads {len(core.router.loads)} busy {core.router.mlx_busy}", flush=True)


def stuck(core: Any, after: float) -> None:
    """A load in the router's table for more than `after` seconds: its state and every
    thread's stack, once (a settle that times out)."""
    seen: dict[tuple[int, Any, float], float] = {}
    while True:
        time.sleep(0.05)
        now = time.perf_counter()
        for load in [*list(core.router.loads.values()), *list(core.router.orphans)]:
            first = seen.setdefault((id(load), load.key, load.t_submit), now)
            if now - first > after:
                fields = ("key", "demand", "started", "predicted", "land", "landed", "abandoned",
                          "shelved", "t_submit", "t_start", "t_read", "t_done")
                print("stuck load", {f: getattr(load, f) for f in fields}, "done", load.done.is_set(),
                      "now", now, "hold", core.router.reader.finisher.hold, "busy", core.router.mlx_busy,
                      flush=True)
                faulthandler.dump_traceback(all_threads=True)
                return


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("container")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--dump", type=float, default=60.0)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--drop", action="store_true", help="probe, then step per layer anyway")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.dump, exit=True)
    cfg = config_from_dict({"model": {"path": args.container}, "pool": {"slots": args.slots},
                            "compute": {"device_wait": args.mode}})
    async with open_engine(cfg) as engine:
        core = engine._core
        if args.drop:
            core.compute.device_wait = None
        print("device wait:", type(core.compute.device_wait).__name__, flush=True)
        threading.Thread(target=watch, args=(core, 5.0), daemon=True).start()
        threading.Thread(target=stuck, args=(core, 1.0), daemon=True).start()
        t0 = time.perf_counter()
        async for event in engine.generate([9707, 11, 1879, 0, 151], SamplingParams(temperature=0.0, max_tokens=args.tokens)):
            if isinstance(event, Done):
                print("done", event.token_ids, f"{time.perf_counter() - t0:.2f} s",
                      "awaited", core.compute.stats.awaited_tokens, "given up", core.compute.stats.awaited_given_up,
                      flush=True)


if __name__ == "__main__":
    trio.run(main)
