"""Where MLX's peak memory is reached: `moestream bench` with every `mx.eval` timed for
the memory it takes above what was active when it was called.

    python benchmarks/eval_peaks.py bench C --pool-mb 1024 --warm --cases long-prompt --long-prompt 1024

Each `mx.eval` call resets MLX's peak, runs, and records its peak less the active memory
before it, under the innermost frame of this project that called it (file:line function)
and the shapes it evaluated. Each case runs in this process (bench runs each in a fresh
one). Prints, after bench's own output, the sites by their largest
such peak, with the calls, the mean and the active memory they started from. A GPU backend
keeps an op's inputs alive until its kernel has run, so a site's peak is what its whole
graph held at once; MLX's CPU backend frees each as it goes. `mx.async_eval` and the
implicit evaluations (`.item()`, `.tolist()`) are not wrapped: what they take lands in
the next wrapped eval's peak. Since every eval resets MLX's peak, bench's own peak figures
(`peak_device_mb`, the memory split) are not valid in these runs; only this report is.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

MIB = 2**20
_lock = threading.Lock()
_sites: dict[str, list[float]] = defaultdict(list)
_starts: dict[str, float] = {}
_shapes: dict[str, str] = {}
_eval = mx.eval


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if (str(ROOT) in frame.filename and "eval_peaks" not in frame.filename
                and "site-packages" not in frame.filename):  # a venv inside the project
            return f"{Path(frame.filename).relative_to(ROOT)}:{frame.lineno} {frame.name}"
    return "?"


def _shape(args: tuple[Any, ...]) -> str:
    arrays = [a for a in args if isinstance(a, mx.array)][:3]
    return " ".join(f"{tuple(a.shape)}{a.dtype}".replace("mlx.core.", "") for a in arrays)


def _peaked_eval(*args: Any) -> None:
    with _lock:  # one eval measured at a time (the MLX thread makes nearly all of them)
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        _eval(*args)
        # MLX's reset sets the peak to 0, not to what is active: an eval that allocates
        # nothing would read as a fall below it.
        peak = (max(mx.get_peak_memory(), before) - before) / MIB
        site = _site()
        if not _sites[site] or peak > max(_sites[site]):
            _starts[site], _shapes[site] = before / MIB, _shape(args)
        _sites[site].append(peak)


def report(top: int = 15) -> None:
    print("\n== eval peaks (MiB above the active memory at the call)")
    rows = sorted(_sites.items(), key=lambda kv: -max(kv[1]))[:top]
    for site, peaks in rows:
        print(f"{max(peaks):8.1f} max {sum(peaks) / len(peaks):7.1f} mean {len(peaks):6d} calls "
              f"from {_starts[site]:7.0f} MiB  {site}  [{_shapes[site]}]")


def main() -> int:
    mx.eval = _peaked_eval
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import moestream_bench

    from pipeline.bench import cases
    from pipeline.cli import bench

    # bench runs each case in a fresh process; here in this one, where mx.eval is wrapped.
    bench.run_case = lambda case, timeout_s=None: cases.measure(case)

    try:
        return moestream_bench.main(sys.argv[1:])
    finally:
        report()


if __name__ == "__main__":
    sys.exit(main())
