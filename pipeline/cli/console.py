"""What `run`, `generate` and `chat` do once parsed: stream text to stdout, stats to stderr.

Imported only when one of those commands runs (it pulls in the engine and MLX).
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import msgspec
import trio
from rich.progress import Progress
from rich.table import Table

from actors.sampling_params import SamplingParams
from pipeline.cli.progress import loaded_engine
from pipeline.cli.term import err
from pipeline.config.schema import PipelineConfig
from pipeline.engine import Engine
from pipeline.events import Done, GenerationStats, TextDelta
from qpack.output_guard import write_file_atomically

if TYPE_CHECKING:
    from pipeline.distributed.stage import Stage


def stats_table(rows: list[tuple[str, GenerationStats]], title: str = "moestream run") -> Table:
    table = Table(title=title)
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


async def run_pipeline(cfg: PipelineConfig, trace_path: str | None, command: str = "run",
                       stage: Stage | None = None) -> int:
    rows: list[tuple[str, GenerationStats]] = []
    async with loaded_engine(cfg, stage=stage,
                             record_routing=cfg.run.record_routing is not None) as engine:
        params = _params(engine, cfg)
        for n, prompt in enumerate(cfg.run.prompts):
            if n == len(cfg.run.prompts) - 1 and cfg.server.prefix_cache_dir is None:
                # Nothing runs after the last prompt: a prefix state kept from it is never
                # read, and its copy would be held through the decode (docs/memory.md).
                engine.prefix_cache.max_entries = 0
            label = prompt if isinstance(prompt, str) else prompt[-1].content
            err.print(f"[bold]> {label}[/bold]  [dim](random weights: the text is gibberish)[/dim]")
            done = await stream(engine, _messages(prompt), params, echo=True)
            rows.append((label, done.stats))
        if cfg.run.record_routing:
            engine.save_routing(cfg.run.record_routing)
    err.print(stats_table(rows, f"moestream {command}"))
    if cfg.run.stats:
        write_file_atomically(cfg.run.stats, msgspec.json.format(msgspec.json.encode(
            {"config": cfg.to_toml_dict(), "runs": [{"prompt": n, **msgspec.to_builtins(s)} for n, s in rows]}
        )))
        err.print(f"stats written to {cfg.run.stats}")
    return 0


def _params(engine: Engine, cfg: PipelineConfig) -> SamplingParams:
    """The config's [sampling] over the model's generation_config.json; run.max_tokens
    when neither caps the length."""
    params = engine.default_params()
    return msgspec.structs.replace(params, max_tokens=params.max_tokens or cfg.run.max_tokens)


async def chat(cfg: PipelineConfig, turns: list[str], stage: Stage | None = None) -> int:
    async with loaded_engine(cfg, stage=stage) as engine:
        params = _params(engine, cfg)
        if not turns:
            return await _interactive(engine, params)
        messages: list[dict[str, str]] = []
        for line in turns:
            print(f">>> {line}")
            await _turn(engine, messages, line, params)
    return 0


async def _turn(engine: Engine, messages: list[dict[str, str]], line: str, params: SamplingParams) -> None:
    messages.append({"role": "user", "content": line})
    done = await stream(engine, messages, params, echo=True)
    messages.append({"role": "assistant", "content": done.text})
    s = done.stats
    err.print(f"[dim]{s.completion_tokens} tokens, {s.decode_tok_s:.2f} tok/s, "
              f"cached {s.cached_tokens}/{s.prompt_tokens} prompt tokens, "
              f"hit rate {s.hit_rate:.1%}[/dim]")


async def _interactive(engine: Engine, params: SamplingParams) -> int:
    """The prompt loop. Ctrl-C stops a reply and returns to the prompt (the conversation so
    far is kept); at the prompt it ends the session quietly, as EOF (Ctrl-D) and /exit do."""
    messages: list[dict[str, str]] = []
    current = trio.CancelScope()
    stdin = StdinLines()

    async def on_sigint(signals: Any) -> None:
        async for _ in signals:
            current.cancel()  # the reply or the prompt, whichever is running

    err.print("[dim]Ctrl-D or /exit leaves; Ctrl-C stops a reply (and, at the prompt, leaves)[/dim]")
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_sigint, signals)
            try:
                while True:
                    sys.stdout.write(">>> ")
                    sys.stdout.flush()
                    with trio.CancelScope() as current:
                        try:
                            # A blocking read cannot be interrupted; on Ctrl-C its thread is
                            # left behind and the session ends without it.
                            line = await trio.to_thread.run_sync(stdin.read_line, abandon_on_cancel=True)
                        except EOFError:
                            return 0
                    if current.cancelled_caught or line.strip() in ("/exit", "/quit"):
                        sys.stdout.write("\n" if current.cancelled_caught else "")
                        return 0
                    if not line.strip():
                        continue  # an empty line is not a turn
                    kept = len(messages)
                    with trio.CancelScope() as current:
                        await _turn(engine, messages, line, params)
                    if current.cancelled_caught:
                        del messages[kept:]  # the interrupted exchange is not part of the conversation
                        sys.stdout.write("\n")
                        err.print("[dim](reply interrupted)[/dim]")
            finally:
                nursery.cancel_scope.cancel()


class StdinLines:
    """Lines from fd 0 through os.read, not input(): a thread left blocked in input() holds
    stdin's buffer lock, and the interpreter then aborts at exit instead of leaving."""

    def __init__(self) -> None:
        self.pending = b""

    def read_line(self) -> str:
        while b"\n" not in self.pending:
            chunk = os.read(0, 4096)
            if not chunk:
                if not self.pending:
                    raise EOFError
                line, self.pending = self.pending, b""
                return line.decode(errors="replace")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode(errors="replace").rstrip("\r")
