"""What one `moestream bench` invocation measured: its cases' results, the ceilings and
ratios derived from them (pipeline/bench/cases.py measures each case in a process of its
own), and the machine they ran on. The JSON report is `Report.to_json`; the tables are
pipeline/bench/report.py's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import msgspec

from pipeline.bench.spec import Result
from pipeline.bench.speculative import spec_derived
from pipeline.bench.warm_pairs import Pairs

__all__ = ["Report", "machine_info"]


@dataclass
class Report:
    """What one `bench` invocation measured, with the derived ceilings and ratios."""

    machine: dict[str, Any]
    container: dict[str, Any]
    command: str
    results: list[Result] = field(default_factory=list)

    def by_name(self, name: str) -> Result | None:
        return next((r for r in self.results if r.name == name and r.error is None), None)

    def derived(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        ok = {r.name: r for r in self.results if r.error is None}  # the cases that ran
        default, serial = self.by_name("default"), self.by_name("serial")
        resident, io = self.by_name("resident"), self.by_name("io")
        if default is not None and io is not None and io.read_gb_s > 0:
            per_tok = default.decode_bytes_per_token
            out["io_ceiling_tok_s"] = io.read_gb_s * 1e9 / per_tok if per_tok > 0 else None
        if default is not None and serial is not None and serial.decode_tok_s > 0:
            out["default_over_serial"] = default.decode_tok_s / serial.decode_tok_s
        ceilings = [c for c in (resident.decode_tok_s if resident else None, out.get("io_ceiling_tok_s"))
                    if c]
        if default is not None and ceilings:
            out["ceiling_tok_s"] = min(ceilings)
            out["default_over_ceiling"] = default.decode_tok_s / min(ceilings)
        warm = self.by_name("warm-all")
        if warm is not None and warm.paired_resident_tok_s:
            pairs = Pairs(warm.paired_engine_tok_s, warm.paired_resident_tok_s)
            out["warm_all_over_resident"], out["warm_all_best_over_resident"] = pairs.ratio, pairs.best_ratio
        elif warm is not None and warm.resident_decode_tok_s > 0:
            out["warm_all_over_resident"] = warm.decode_tok_s / warm.resident_decode_tok_s
        one_pass = self.by_name("long-prompt")
        for name in ("long-prompt", "long-prompt-c256"):
            long = self.by_name(name)
            if long is not None and one_pass is not None and io is not None and io.read_gb_s > 0 \
                    and one_pass.prefill_bytes:
                # One pass of the disk: the expert bytes this prompt needs, read once each
                # (what the pool-sized chunk read, when the pool holds a layer's experts).
                need = one_pass.prefill_bytes
                ceiling = long.prompt_tokens / (need / (io.read_gb_s * 1e9))
                key = name.replace("-", "_")
                out[f"{key}_prefill_ceiling_tok_s"] = ceiling
                out[f"{key}_prefill_over_ceiling"] = long.prefill_tok_s / ceiling
        from pipeline.bench.agreement import tokens_as_default, tokens_as_reference
        from pipeline.bench.batch import batch_derived
        from pipeline.bench.rounds import tok_s_by_round

        out.update(batch_derived(ok))
        out.update(spec_derived(ok))
        if rounds := tok_s_by_round(ok):
            out["decode_tok_s_rounds"] = rounds
        if agree := tokens_as_default(ok):
            out["tokens_as_default"] = agree
        if spec_agree := tokens_as_reference(ok):
            out["tokens_as_reference"] = spec_agree
        if default is not None:
            # The dense core held (the measured split's: less a token embedding on file, more
            # an lm_head widened), not its size on file.
            dense = (default.memory or {}).get("dense_mb") or self.container["dense_mb"]
            budget = dense + default.pool_mb + 256
            gpu = "gpu" in default.backend
            total = default.peak_rss_mb + (default.peak_device_mb if gpu else 0.0)
            # On the CPU MLX's memory is the process's: RSS alone is the total. On CUDA,
            # device memory (cudaMallocAsync) is outside the RSS; managed memory is in it
            # while its pages are on the host, so the sum may over-count a little.
            out["memory_total_mb"] = total
            out["memory_max_mb"] = max(default.peak_rss_mb, default.peak_device_mb)
            decoding = default.decode_rss_mb + (default.decode_device_mb if gpu else 0.0)
            out["memory_decode_mb"] = decoding
            out["memory_budget_mb"] = budget
            out["memory_over_budget_mb"] = total - budget
            out["memory_decode_over_budget_mb"] = decoding - budget
        for r in self.results:  # host RSS above the process with its device runtime up
            m = r.memory or {}
            if r.error is None and "runtime_mb" in m:
                out[f"{r.name.replace('-', '_')}_rss_over_runtime_mb"] = (
                    r.peak_rss_mb - (m.get("process_mb") or 0.0) - (m["runtime_mb"] or 0.0))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "container": self.container, "command": self.command,
                "results": [msgspec.to_builtins(r) for r in self.results], "derived": self.derived()}


def machine_info() -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {"host": platform.node(), "cpu_count": os.cpu_count(),
                            "python": platform.python_version(),
                            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        import mlx.core as mx

        info["mlx"] = metadata.version("mlx")
        info["device"] = str(mx.default_device())
        if hasattr(mx, "device_info"):
            info["device_info"] = {k: str(v) for k, v in mx.device_info().items()}
    except Exception as exc:  # noqa: BLE001 - informational only
        info["mlx_error"] = str(exc)
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kb"] = int(f.readline().split()[1])
    except OSError:
        pass
    return info
