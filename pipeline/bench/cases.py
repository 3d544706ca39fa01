"""`moestream bench`: what the streamer achieves, next to what it could.

Each configuration runs in its own process (`python -m pipeline.bench CASE_JSON`), so
its peak RSS and peak MLX memory are its own, and is measured the product's way: one
`engine.generate` over a fixed random prompt. Before the measured generation a tiny
warm-up compiles the kernels; a cold case then drops the container's pages.

Per case: decode and prefill tok/s, time to first token, peak host RSS and MLX device
memory, bytes read per decode token, pool hit rate (whole run and decode only),
prefetch precision/recall and the fraction of decode time compute stalled on reads.
References: "serial" (no prefetch, no overlap), "resident" (mlx-lm, every expert in
memory) and the I/O ceiling (measured read bandwidth / bytes a decode token reads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec

from pipeline import engine_hooks as hooks
from pipeline.bench.spec import Case, Result, backend, engine_dict, prompt_ids
from pipeline.bench.speculative import spec_result_fields
from pipeline.bench.warm_pairs import finished, pair_fields, paired, wants_resident

__all__ = ["Case", "Result", "engine_dict", "prompt_ids", "run_case"]


async def measure_engine(case: Case) -> Result:
    """One case in this process: open the engine, warm up, (cold) measure one generation."""
    from actors import timeline
    from actors.sampling_params import SamplingParams
    from pipeline.bench.read_path import between
    from pipeline.bench.refs import drop_page_cache
    from pipeline.bench.routing import calibrate
    from pipeline.bench.thread_cpu import between as cpu_between
    from pipeline.bench.thread_cpu import sample as cpu_sample
    from pipeline.config.loading import config_from_dict
    from pipeline.counters import Counters
    from pipeline.engine import open_engine
    from pipeline.events import Done
    from pipeline.resident_map import resident_by_mapping, resident_kinds

    cfg = config_from_dict(engine_dict(case), source=f"<bench {case.name}>")
    started = time.perf_counter()
    phases: dict[str, float] = {}
    async with open_engine(cfg) as engine:
        if case.warm_all:
            await engine.warm()
        phases["open_s"] = time.perf_counter() - started
        override = calibrate(engine, case.routing, case.seed)
        facts = engine.facts
        # Warm-up with the measured prompt's length: MLX's CUDA backend JIT-compiles a
        # kernel per new shape (tens of seconds the first time), which is not TTFT.
        warm = SamplingParams(temperature=1.0, seed=case.seed + 1, max_tokens=2)
        warm_prompt = prompt_ids(case.prompt_tokens, facts.vocab_size, case.seed + 99)
        if case.emulate is not None and case.warm_all:
            # Every expert pooled, a second run reads nothing: the warm-up is the
            # measured generation itself (`_warm_passes`).
            warm = SamplingParams(temperature=1.0, seed=case.seed, max_tokens=case.max_tokens)
            warm_prompt = prompt_ids(case.prompt_tokens, facts.vocab_size, case.seed)
        elif case.emulate is not None:
            # Cold: a short generation of another prompt, so the pool and page cache do
            # not start with the measured tokens' experts.
            warm = msgspec.structs.replace(warm, max_tokens=_COLD_PASS_WARMUP)
        reference = await _tokens(engine, warm_prompt, warm)
        if case.emulate is not None:
            await _warm_passes(engine, case, warm_prompt, warm, reference)
        await hooks.forget_prefixes(engine)  # the warm-up's states: not this request's
        phases["warmup_s"] = time.perf_counter() - started - phases["open_s"]
        if case.cold and not case.warm_all:
            drop_page_cache(case.model)
        if override is not None:
            # The warm-up was request 0, the other domain; this one's table drawn now.
            override.begin_request(1, rows=case.prompt_tokens + case.max_tokens)
        if case.emulate is not None:
            _emulate(engine, case)
        at_decode: list[Counters] = []
        cpu_at_decode: dict[int, tuple[str, float]] = {}  # the threads' CPU time then

        def first_decode(phase: str) -> None:
            # The first decode token's start splits prefill from decode (pipelined or
            # not, every forward starts here).
            if phase == "decode" and not at_decode:
                at_decode.append(engine.counters())
                cpu_at_decode.update(cpu_sample())

        before = engine.counters()
        params = SamplingParams(temperature=1.0, seed=case.seed, max_tokens=case.max_tokens)
        prompt = prompt_ids(case.prompt_tokens, facts.vocab_size, case.seed)
        with timeline.recording(case.trace), engine.watch_tokens(first_decode):
            done: Done = await finished(engine, prompt, params)
        end, cpu_end = engine.counters(), cpu_sample()
        read_path = between(at_decode[0] if at_decode else None, end, facts.expert_stride)
        if at_decode:
            read_path.thread_cpu_s = cpu_between(cpu_at_decode, cpu_end)
        s = done.stats
        # The split of the measured run's peak, and the process as it was then: the pairs
        # below add their own states to the prefix cache and load mlx-lm's model beside.
        memory = msgspec.to_builtins(engine.memory_breakdown(
            s.peak_rss_mb, s.peak_device_mb, s.prompt_tokens + s.completion_tokens))
        os_threads, rss_kinds, rss_by_mapping = _os_threads(), resident_kinds(), resident_by_mapping()
        pairs = await paired(engine, case, prompt, params)
        decoded = max(s.completion_tokens - 1, 0)
        decode = end - (at_decode[0] if at_decode else end)
        prefill = (at_decode[0] if at_decode else before) - before
        spent = end - before
        return Result(
            name=case.name, kind=case.kind, prompt_tokens=s.prompt_tokens, max_tokens=case.max_tokens,
            completion_tokens=s.completion_tokens, decode_tok_s=s.decode_tok_s,
            prefill_tok_s=s.prefill_tok_s, ttft_s=s.ttft_s, peak_rss_mb=s.peak_rss_mb,
            peak_device_mb=s.peak_device_mb, decode_rss_mb=s.decode_rss_mb,
            decode_device_mb=s.decode_device_mb, pool_mb=facts.pool_bytes / 2**20,
            slots=facts.slots, readers=facts.readers, readers_prefill=facts.readers_prefill,
            reader_io=facts.reader_io,
            strategy=_strategy_label(cfg.prefetch) if cfg.compute.overlap else "none",
            eviction=cfg.pool.eviction, overlap=cfg.compute.overlap,
            o_direct=facts.o_direct, device_copy=facts.device_copy, hit_rate=s.hit_rate,
            decode_hit_rate=decode.hit_rate,
            bytes_read_per_token=s.bytes_read_per_token,
            decode_bytes_per_token=decode.bytes_read / decoded if decoded else 0.0,
            prefetch_precision=s.prefetch_precision, prefetch_recall=s.prefetch_recall,
            stall_fraction=s.stall_fraction, backend=backend(),
            routing=override.label if override is not None else "router",
            os_threads=os_threads, rss_kinds=rss_kinds, rss_by_mapping=rss_by_mapping,
            prefill_chunk=facts.prefill_chunk,
            prefill_bytes=prefill.bytes_read if at_decode else 0,
            run_ahead_tokens=spent.run_ahead_tokens,
            run_ahead_misses=spent.run_ahead_misses,
            ahead_steps=spent.ahead_steps,
            awaited_tokens=spent.awaited_tokens,
            seconds=time.perf_counter() - started, read_path=read_path,
            memory=memory,
            queue_depth_gb_s=_probed(cfg, engine), open_s=phases["open_s"],
            warmup_s=phases["warmup_s"], token_ids=list(done.token_ids),
            **spec_result_fields(s, case), **pair_fields(pairs),
        )


_COLD_PASS_WARMUP = 8  # tokens of a cold case's warm-up generations (each reads experts)


async def _tokens(engine: Any, prompt: list[int], params: Any) -> list[int]:
    """One generation's tokens (run to the end)."""
    return list((await finished(engine, prompt, params)).token_ids)


async def _warm_passes(engine: Any, case: Case, prompt: list[int], params: Any,
                       reference: list[int]) -> None:
    """Verify passes meet shapes plain decode never does (each pass length, each kept
    prefix's DeltaNet recompute), and MLX's CUDA backend compiles a kernel per new shape
    (hundreds of ms each in a fresh process): before the measured run, `prompt` decodes
    with drafts from `reference` (its own plain tokens) at the case's acceptance, once
    per draft length up to the case's. Every expert pooled, `auto` keeps what these
    passes taught it (a server's steady state: the measured run is the same regime, and a
    length's compiling first pass is priced over by its second); cold, it forgets them,
    as a freshly opened engine would (they ran on a pool warmed by this very prompt)."""
    from pipeline.speculation import EmulatedDrafts

    assert case.emulate is not None
    longest = engine.config.compute.draft_tokens
    drafting = msgspec.structs.replace(params, speculative="ngram")
    for n in range(1, longest + 1):
        hooks.emulate_drafts(engine, EmulatedDrafts(reference, case.emulate, case.seed, longest=n))
        await _tokens(engine, prompt, drafting)
    if not case.warm_all:
        hooks.reset_speculation(engine)


def _emulate(engine: Any, case: Case) -> None:
    """The case's emulated drafts (benchmark only): the reference run's tokens."""
    from pipeline.speculation import EmulatedDrafts

    assert case.emulate is not None
    hooks.emulate_drafts(engine, EmulatedDrafts(case.draft_reference, case.emulate, case.seed))


def _probed(cfg: Any, engine: Any) -> dict[int, float]:
    """What the readers=auto probe measured (depth -> GB/s); empty for a fixed count."""
    if cfg.reader.concurrency != "auto" or not cfg.compute.overlap:
        return {}
    from actors.queue_depth import choose_depth

    return dict(choose_depth(engine.container).gb_s)  # measured at open: cached


def _strategy_label(prefetch: Any) -> str:
    parts = "+".join(prefetch.combine) if prefetch.strategy == "combined" else prefetch.strategy
    return f"{parts} depth {prefetch.depth}" if prefetch.depth > 1 else parts


def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _resident(case: Case) -> Any:
    """mlx-lm's resident decode of the case's prompt (pipeline/bench/refs.py)."""
    from pipeline.bench.refs import resident_decode
    from qpack.reader import Container

    with Container.open(case.model, verify="off") as c:
        vocab = int(c.config.get("text_config", c.config)["vocab_size"])
    return resident_decode(case.model, prompt_ids(case.prompt_tokens, vocab, case.seed),
                           case.max_tokens, case.seed)


def measure(case: Case) -> Result:
    """Run one case in this process (the worker side)."""
    import trio

    from pipeline.bench.refs import best_bandwidth, read_bandwidth

    started = time.perf_counter()
    if case.kind == "moestream" and case.concurrency:
        from pipeline.bench.batch import measure_batch

        return trio.run(measure_batch, case)
    if case.kind == "moestream":
        result = trio.run(measure_engine, case)
        if wants_resident(case) and not result.paired_resident_tok_s:
            # The compute ceiling, measured in this same process and GPU state.
            result.resident_decode_tok_s = _resident(case).decode_tok_s
        return result
    if case.kind == "resident":
        from pipeline.memory_facts import OpenMarks, runtime_up
        from pipeline.resident_map import peak_rss_mb

        marks = OpenMarks()  # the engine's marks: its RSS over the runtime compares
        runtime_up()
        marks.after_runtime()
        r = _resident(case)
        peak = peak_rss_mb()
        return Result(name=case.name, kind="resident", prompt_tokens=case.prompt_tokens,
                      max_tokens=case.max_tokens, completion_tokens=r.tokens,
                      decode_tok_s=r.decode_tok_s, prefill_tok_s=r.prefill_tok_s, ttft_s=r.ttft_s,
                      peak_rss_mb=peak, peak_device_mb=r.peak_device_mb,
                      pool_mb=r.model_bytes / 2**20, backend=backend(),
                      memory={"peak_rss_mb": peak, "process_mb": marks.start_mb,
                              "runtime_mb": marks.runtime_mb},
                      seconds=time.perf_counter() - started)
    if case.kind == "io":
        reader = case.config.get("reader", {})
        o_direct = bool(reader.get("o_direct", False))
        threads = reader.get("concurrency", "auto")
        depths: dict[int, float] = {}
        if threads == "auto":  # the disk's bandwidth at the depth where it is fastest
            bw, depths = best_bandwidth(case.model, o_direct=o_direct, cold=case.cold)
        else:
            bw = read_bandwidth(case.model, threads=int(threads), o_direct=o_direct, cold=case.cold)
        return Result(name=case.name, kind="io", readers=bw.threads, o_direct=bw.o_direct,
                      read_gb_s=bw.gb_s, queue_depth_gb_s=depths,
                      seconds=time.perf_counter() - started)
    raise ValueError(f"case {case.name!r}: unknown kind {case.kind!r} (moestream, resident, io)")


def run_case(case: Case, timeout_s: float | None = None) -> Result:
    """Run one case in a fresh process; a crash or timeout becomes a Result with `error`."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
    cmd = [sys.executable, "-m", "pipeline.bench.cases", msgspec.json.encode(case).decode()]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Result(name=case.name, kind=case.kind, error=f"timed out after {timeout_s} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        # A crash (the worker reports its own exceptions): the last line says what killed it.
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return Result(name=case.name, kind=case.kind, error=f"exit {proc.returncode}: {tail[0]}")
    return msgspec.json.decode(lines[-1], type=Result)


def main(argv: list[str]) -> int:
    """Worker entry: one Case as JSON in argv[1]; one Result as JSON on stdout's last line."""
    from pipeline.failures import one_line
    from pipeline.logging_setup import configure_logging

    configure_logging("warning", False)
    case = msgspec.json.decode(argv[1], type=Case)
    try:
        result = measure(case)
    except Exception as e:  # noqa: BLE001 - the worker reports one line per case, not a traceback
        traceback.print_exc()  # to stderr, which the parent keeps only on a crash
        result = Result(name=case.name, kind=case.kind, error=one_line(e))
    sys.stdout.write("\n" + json.dumps(msgspec.to_builtins(result)) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
