"""`moestream run`, `generate` and `chat`: the command-line faces of the engine."""

from __future__ import annotations

import argparse
import sys
from contextlib import aclosing
from pathlib import Path
from typing import Any

import msgspec
import trio
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from actors.sampler import SamplingParams
from pipeline import timeline
from pipeline.config import ConfigError, PipelineConfig, config_from_dict, load_config
from pipeline.engine import Engine, open_engine
from pipeline.events import Done, GenerationStats, TextDelta
from pipeline.prepare import ensure_container

# Wide enough for the stats table even when stderr is not a terminal.
err = Console(stderr=True, width=160)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Flags that override config keys; shared by generate, chat, serve and bench."""
    g = p.add_argument_group("engine")
    g.add_argument("--config", type=Path, help="a TOML config to start from (flags override it)")
    g.add_argument("--pool-mb", type=int, help="expert pool budget in MiB")
    g.add_argument("--slots", type=int, help="expert pool size in experts (instead of --pool-mb)")
    g.add_argument("--strategy", help="prefetch: none, next-gate, lookahead, history, transition")
    g.add_argument("--depth", type=int, help="layers ahead for lookahead prefetch")
    g.add_argument("--eviction", help="pool eviction policy: lfu, lru, slru")
    g.add_argument("--readers", type=int, help="expert reads in flight at once")
    g.add_argument("--prefill-chunk", type=int, help="prompt tokens per prefill step")
    g.add_argument("--no-overlap", action="store_true", help="serial streamer: no prefetch or overlap")
    g.add_argument("--verify", choices=["off", "first-use", "full", "always"],
                   help="expert checksums: at first read (default), all at open, every read, or off")
    g.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override any config key; repeatable")
    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", type=float)
    s.add_argument("--top-p", type=float)
    s.add_argument("--top-k", type=int)
    s.add_argument("--min-p", type=float)
    s.add_argument("--seed", type=int)
    s.add_argument("--max-tokens", type=int)
    s.add_argument("--stop", action="append", help="a stop string; repeatable")


_FLAG_KEYS = {
    "pool_mb": ("pool", "budget_mb"),
    "slots": ("pool", "slots"),
    "strategy": ("prefetch", "strategy"),
    "depth": ("prefetch", "depth"),
    "eviction": ("pool", "eviction"),
    "readers": ("reader", "concurrency"),
    "prefill_chunk": ("compute", "prefill_chunk"),
    "verify": ("model", "verify"),
    "temperature": ("sampling", "temperature"),
    "top_p": ("sampling", "top_p"),
    "top_k": ("sampling", "top_k"),
    "min_p": ("sampling", "min_p"),
    "seed": ("sampling", "seed"),
    "max_tokens": ("sampling", "max_tokens"),
}


def engine_config(args: argparse.Namespace, model: str | None = None) -> PipelineConfig:
    """The config file (if any), then the flags, validated as one config."""
    import tomllib

    raw: dict[str, Any] = {}
    text = ""
    if args.config is not None:
        try:
            text = args.config.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {args.config}") from None
        raw = tomllib.loads(text)
    if model is not None:
        raw.setdefault("model", {})["path"] = model
    for flag, (section, key) in _FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if value is not None:
            if flag == "pool_mb":
                raw.setdefault("pool", {}).pop("slots", None)
            if flag == "slots":
                raw.setdefault("pool", {}).pop("budget_mb", None)
            raw.setdefault(section, {})[key] = value
    if getattr(args, "stop", None):
        raw.setdefault("sampling", {})["stop"] = list(args.stop)
    if getattr(args, "no_overlap", False):
        raw.setdefault("compute", {})["overlap"] = False
    return config_from_dict(raw, source=str(args.config or "<flags>"), text=text,
                            overrides=args.overrides)


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


async def _run(cfg: PipelineConfig, trace_path: str | None) -> int:
    params = msgspec.structs.replace(cfg.sampling, max_tokens=cfg.sampling.max_tokens or cfg.run.max_tokens)
    rows: list[tuple[str, GenerationStats]] = []
    async with open_engine(cfg, record_routing=cfg.run.record_routing is not None) as engine:
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


def _cmd_run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config_file, args.overrides, check_paths=False)
        ensure_container(cfg.model)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 2
    if args.record_routing:
        cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, record_routing=args.record_routing))
    with timeline.recording(args.trace or cfg.run.trace):
        return trio.run(_run, cfg, args.trace)


def _cmd_generate(args: argparse.Namespace) -> int:
    try:
        cfg = engine_config(args, args.model)
    except (ConfigError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 2
    prompts = tuple(args.prompt or ["Hello"])
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(
        cfg.run, prompts=prompts, stats=args.stats, record_routing=args.record_routing))
    return trio.run(_run, cfg, None)


async def _chat(cfg: PipelineConfig, turns: list[str]) -> int:
    params = msgspec.structs.replace(cfg.sampling, max_tokens=cfg.sampling.max_tokens or cfg.run.max_tokens)
    messages: list[dict[str, str]] = []
    async with open_engine(cfg) as engine:
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


def _cmd_chat(args: argparse.Namespace) -> int:
    try:
        cfg = engine_config(args, args.model)
    except (ConfigError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 2
    return trio.run(_chat, cfg, list(args.turns))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the pipeline a TOML config describes",
                       description="Pack the model on first use, then generate for every prompt "
                       "in [run] and print (and save) the measured stats.")
    p.add_argument("config_file", type=Path, metavar="CONFIG", help="e.g. config/demo.toml")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override a config key; repeatable")
    p.add_argument("--trace", help="write a Chrome/Perfetto timeline JSON here")
    p.add_argument("--record-routing", help="save the routing trace here (for `replay`)")
    p.set_defaults(func=_cmd_run)

    g = sub.add_parser("generate", help="one-shot generation from a container, with stats",
                       description="Stream a completion for each --prompt and print tok/s, "
                       "pool hit rate and peak memory.")
    g.add_argument("model", help="path of a .qpack container")
    g.add_argument("--prompt", action="append", help="prompt text; repeatable")
    g.add_argument("--stats", help="write the stats as JSON here")
    g.add_argument("--record-routing", help="save the routing trace here (for `replay`)")
    add_engine_flags(g)
    g.set_defaults(func=_cmd_generate)

    c = sub.add_parser("chat", help="chat with a model (interactive without TURNs)",
                       description="Multi-turn chat; each turn reuses the conversation's cached "
                       "state. Give turns as arguments, or none for an interactive prompt.")
    c.add_argument("model", help="path of a .qpack container")
    c.add_argument("turns", nargs="*", metavar="TURN", help="user turns to send in order")
    add_engine_flags(c)
    c.set_defaults(func=_cmd_chat)
