"""What `run`, `generate` and `chat` do once parsed: stream text to stdout, stats to stderr.

Imported only when one of those commands runs (it pulls in the engine and MLX).
"""

from __future__ import annotations

import sys
from contextlib import aclosing
from pathlib import Path
from typing import Any

import msgspec
import trio
from rich.progress import Progress
from rich.table import Table

from actors.sampling_params import SamplingParams
from pipeline.cli.term import err
from pipeline.config.schema import PipelineConfig
from pipeline.engine import Engine, open_engine
from pipeline.events import Done, GenerationStats, TextDelta
from pipeline.generation_config import default_params


def stats_table(rows: list[tuple[str, GenerationStats]]) -> Table:
    table = Table(title="moestream run")
    for col in ("prompt", "tokens in/out", "TTFT s", "prefill tok/s", "decode tok/s", "hit rate",
                "MB read/tok", "stall", "prefetch P/R", "RSS MB peak/dec", "dev MB peak/dec"):
        table.add_column(col, justify="right" if col != "prompt" else "left")
    for name, s in rows:
        table.add_row(
            name[:28], f"{s.prompt_tokens}/{s.completion_tokens}", f"{s.ttft_s:.2f}",
            f"{s.prefill_tok_s:.1f}", f"{s.decode_tok_s:.2f}", f"{s.hit_rate:.1%}",
            f"{s.bytes_read_per_token / 2**20:.2f}", f"{s.stall_fraction:.0%}",
            f"{s.prefetch_precision:.2f}/{s.prefetch_recall:.2f}",
            f"{s.peak_rss_mb:.0f}/{s.decode_rss_mb:.0f}", f"{s.peak_device_mb:.0f}/{s.decode_device_mb:.0f}",
        )
    return table


PROGRESS_MIN_TOKENS = 512  # prompts shorter than this prefill too fast for a bar to help


async def stream(engine: Engine, prompt: Any, params: SamplingParams, echo: bool) -> Done:
    progress: Progress | None = None

    def on_prefill(done: int, total: int) -> None:
        nonlocal progress
        if total < PROGRESS_MIN_TOKENS:
            return
        if progress is None:
            progress = Progress(transient=True, console=err)
            progress.start()
            progress.add_task("prefill", total=total)
        progress.update(progress.task_ids[0], completed=done)
        if done >= total:
            progress.stop()

    if isinstance(prompt, list):
        events = engine.chat(prompt, params, on_prefill=on_prefill)
    else:
        events = engine.generate(prompt, params, on_prefill)
    try:
        return await _consume(events, echo)
    finally:
        if progress is not None:
            progress.stop()


async def _consume(events: Any, echo: bool) -> Done:
    async with aclosing(events) as it:
        async for event in it:
            if isinstance(event, TextDelta):
                if echo:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            else:
                if echo:
                    sys.stdout.write("\n")
                return event
    raise RuntimeError("generation ended without a Done event")


def _messages(prompt: Any) -> Any:
    if isinstance(prompt, str):
        return prompt
    return [{"role": m.role, "content": m.content} for m in prompt]


async def run_pipeline(cfg: PipelineConfig, trace_path: str | None) -> int:
    rows: list[tuple[str, GenerationStats]] = []
    async with open_engine(cfg, record_routing=cfg.run.record_routing is not None) as engine:
        params = _params(engine, cfg)
        for prompt in cfg.run.prompts:
            label = prompt if isinstance(prompt, str) else prompt[-1].content
            err.print(f"[bold]> {label}[/bold]  [dim](random weights: the text is gibberish)[/dim]")
            done = await stream(engine, _messages(prompt), params, echo=True)
            rows.append((label, done.stats))
        if engine.compute.recorder is not None and cfg.run.record_routing:
            engine.compute.recorder.save(cfg.run.record_routing)
    err.print(stats_table(rows))
    if cfg.run.stats:
        Path(cfg.run.stats).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.run.stats).write_bytes(msgspec.json.format(msgspec.json.encode(
            {"config": cfg.to_toml_dict(), "runs": [{"prompt": n, **msgspec.to_builtins(s)} for n, s in rows]}
        )))
        err.print(f"stats written to {cfg.run.stats}")
    return 0


def _params(engine: Engine, cfg: PipelineConfig) -> SamplingParams:
    """The config's [sampling] over the model's generation_config.json; run.max_tokens
    when neither caps the length."""
    params = default_params(engine)
    return msgspec.structs.replace(params, max_tokens=params.max_tokens or cfg.run.max_tokens)


async def chat(cfg: PipelineConfig, turns: list[str]) -> int:
    messages: list[dict[str, str]] = []
    async with open_engine(cfg) as engine:
        params = _params(engine, cfg)
        interactive = not turns
        while True:
            if interactive:
                try:
                    line = await trio.to_thread.run_sync(input, ">>> ")
                except EOFError:
                    return 0
                if line.strip() in ("/exit", "/quit"):
                    return 0
            else:
                if not turns:
                    return 0
                line = turns.pop(0)
                print(f">>> {line}")
            messages.append({"role": "user", "content": line})
            done = await stream(engine, messages, params, echo=True)
            messages.append({"role": "assistant", "content": done.text})
            s = done.stats
            err.print(f"[dim]{s.completion_tokens} tokens, {s.decode_tok_s:.2f} tok/s, "
                      f"cached {s.cached_tokens}/{s.prompt_tokens} prompt tokens, "
                      f"hit rate {s.hit_rate:.1%}[/dim]")
