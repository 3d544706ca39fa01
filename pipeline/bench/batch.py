"""`moestream bench` batch cases: N sequences decoding at once, in one decode batch.

`batch-N` (the configured pool, cold disk) and `batch-warm-N` (every expert pooled):
N generations of different random prompts start together; each prefills alone, then
they decode in one batch, so a step reads the union of the rows' experts once. Reported:
the aggregate decode tok/s (every row's decoded tokens over the wall time from the first
row's first token to the last row's end) and each row's own time per token.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any

from pipeline.bench.spec import Case, Result, backend, engine_dict, prompt_ids


async def _one(engine: Any, prompt: list[int], params: Any, marks: dict[str, float]) -> Any:
    from pipeline.events import Done, TextDelta

    done = None
    async with aclosing(engine.generate(prompt, params)) as it:
        async for event in it:
            if isinstance(event, TextDelta) and event.token_ids and "first" not in marks:
                marks["first"] = time.perf_counter()
            if isinstance(event, Done):
                done = event
    marks["end"] = time.perf_counter()
    return done


async def measure_batch(case: Case) -> Result:
    import trio

    from actors.sampling_params import SamplingParams
    from pipeline.bench.refs import drop_page_cache
    from pipeline.bench.routing import calibrate
    from pipeline.config.loading import config_from_dict
    from pipeline.engine import open_engine

    n = case.concurrency
    raw = engine_dict(case)
    raw.setdefault("compute", {})["max_batch"] = max(n, 1)
    cfg = config_from_dict(raw, source=f"<bench {case.name}>")
    started = time.perf_counter()
    async with open_engine(cfg) as engine:
        if case.warm_all:
            await engine.warm()
        open_s = time.perf_counter() - started
        # Calibrated routing: each generation routes as its own request (tagged when its
        # caches are made): the warm-up's are requests 0..N-1, the measured N..2N-1, so
        # the rows alternate between the two prompt domains.
        override = calibrate(engine, case.routing, case.seed)
        facts = engine.facts

        async def run_all(max_tokens: list[int], seed: int) -> list[tuple[Any, dict[str, float]]]:
            out: list[tuple[Any, dict[str, float]]] = [(None, {}) for _ in max_tokens]

            async def one(i: int) -> None:
                params = SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_tokens[i])
                prompt = prompt_ids(case.prompt_tokens, facts.vocab_size, seed + i)
                out[i] = (await _one(engine, prompt, params, out[i][1]), out[i][1])

            async with trio.open_nursery() as nursery:
                for i in range(len(max_tokens)):
                    nursery.start_soon(one, i)
            return out

        # Warm-up: rows of different lengths, so every batch size 1..N compiles its
        # kernels here (MLX's CUDA backend JIT-compiles per shape), not in the measurement.
        await run_all([2 + i for i in range(n)], case.seed + 1000)
        warmup_s = time.perf_counter() - started - open_s
        if case.cold and not case.warm_all:
            drop_page_cache(case.model)
        if override is not None:
            override.begin_request(n, rows=case.prompt_tokens + case.max_tokens, requests=n)
        before = engine.counters()
        runs = await run_all([case.max_tokens] * n, case.seed)
        spent = engine.counters() - before
    dones = [d for d, _ in runs]
    if any(d is None for d in dones):
        raise RuntimeError("a batch row ended without its Done event")
    decoded = sum(max(d.stats.completion_tokens - 1, 0) for d in dones)
    t_first = min(m["first"] for _, m in runs)
    t_end = max(m["end"] for _, m in runs)
    per_row_ms = [1000.0 / d.stats.decode_tok_s for d in dones if d.stats.decode_tok_s > 0]
    return Result(
        name=case.name, kind=case.kind, prompt_tokens=case.prompt_tokens,
        max_tokens=case.max_tokens, completion_tokens=sum(d.stats.completion_tokens for d in dones),
        decode_tok_s=decoded / max(t_end - t_first, 1e-9),
        prefill_tok_s=sum(d.stats.prefill_tok_s for d in dones) / n,
        ttft_s=max(d.stats.ttft_s for d in dones),
        peak_rss_mb=max(d.stats.peak_rss_mb for d in dones),
        peak_device_mb=max(d.stats.peak_device_mb for d in dones),
        pool_mb=facts.pool_bytes / 2**20, slots=facts.slots,
        readers=facts.readers, strategy=cfg.prefetch.strategy,
        eviction=cfg.pool.eviction,
        o_direct=facts.o_direct,
        hit_rate=spent.hit_rate,
        bytes_read_per_token=spent.bytes_read / max(decoded, 1),
        concurrency=n,
        per_seq_ms_per_token=max(per_row_ms, default=0.0),
        per_seq_ms_per_token_mean=sum(per_row_ms) / len(per_row_ms) if per_row_ms else 0.0,
        batch_rows_per_step=spent.batch_rows_stepped / max(spent.batch_steps, 1),
        routing=override.label if override is not None else "router",
        backend=backend(), open_s=open_s, warmup_s=warmup_s,
        seconds=time.perf_counter() - started,
    )


def batch_derived(results: dict[str, Result]) -> dict[str, Any]:
    """Aggregate tok/s and per-row time per token at N, relative to N = 1 of the same
    routing (`batch-4@router` against `batch-1@router`)."""
    out: dict[str, Any] = {}
    for name, r in results.items():
        base, _, routing = name.partition("@")
        prefix, _, count = base.rpartition("-")
        if prefix not in ("batch", "batch-warm") or not count.isdigit():
            continue
        suffix = f"@{routing}" if routing else ""
        one = results.get(f"{prefix}-1{suffix}")
        if one is None or one.decode_tok_s <= 0:
            continue
        key = name.replace("-", "_")
        out[f"{key}_aggregate_over_1"] = r.decode_tok_s / one.decode_tok_s
        if one.per_seq_ms_per_token > 0:
            out[f"{key}_ms_per_token_over_1"] = r.per_seq_ms_per_token / one.per_seq_ms_per_token
    return out
