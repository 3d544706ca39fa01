"""`moestream run`, `generate` and `chat`: the command-line faces of the engine."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.failures import refused
from qpack.spec import QpackError

if TYPE_CHECKING:
    from pipeline.config.schema import PipelineConfig



def count_or(*words: str) -> Callable[[str], int | str]:
    """An argparse type: a count or one of `words` (the config checks the count's range)."""
    expected = ", ".join(["a number", *words[:-1]]) + f" or {words[-1]}"

    def parse(text: str) -> int | str:
        if text in words:
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}") from None

    return parse


readers_arg = count_or("auto")  # --readers: "auto" or a count


def budget_arg(text: str) -> int | str:
    """--memory-mb: MiB, "auto" or "off"."""
    if text in ("auto", "off"):
        return text
    from pipeline.config.schema import MIB_MAX

    try:
        mib = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MiB, auto or off, not {text!r}") from None
    if not 1 <= mib <= MIB_MAX:  # memory.budget_mb's range, for commands that build no config
        raise argparse.ArgumentTypeError(f"expected MiB in [1, {MIB_MAX:_}], auto or off, not {text!r}")
    return mib


def add_engine_flags(p: argparse.ArgumentParser, *, config_flag: bool = True) -> None:
    """Flags that override config keys; shared by run, generate, chat and serve."""
    from actors.prefetch.registry import DEPTH_STRATEGIES, strategies_help  # the registries
    from pipeline.config.schema import EVICTION_POLICIES

    g = p.add_argument_group("engine")
    if config_flag:
        g.add_argument("--config", type=Path, help="a TOML config to start from (flags override it)")
    g.add_argument("--memory-mb", type=budget_arg, help="total memory budget in MiB, auto "
                   "(what the process holds plus 80%% of the available memory) or off: the expert "
                   "pool gets what the rest leaves (memory.budget_mb; default auto on the CPU and "
                   "unified memory unless --pool-mb or --slots; docs/memory.md)")
    g.add_argument("--pool-mb", type=int, help="expert pool budget in MiB")
    g.add_argument("--slots", type=int, help="expert pool size in experts (instead of --pool-mb)")
    g.add_argument("--strategy", help=f"prefetch strategy (default next-gate): {strategies_help()}")
    g.add_argument("--depth", type=int,
                   help=f"layers ahead the strategy predicts ({', '.join(DEPTH_STRATEGIES)})")
    g.add_argument("--eviction", help=f"pool eviction policy: {', '.join(EVICTION_POLICIES)} "
                   "(default reuse)")
    g.add_argument("--readers", type=readers_arg,
                   help="expert reads in flight at once: a number or auto (measured at start; default)")
    g.add_argument("--prefill-chunk", type=int, help="prompt tokens per prefill step")
    g.add_argument("--no-overlap", action="store_true", help="serial streamer: no prefetch or overlap")
    g.add_argument("--speculative", choices=["auto", "mtp", "ngram", "off"],
                   help="speculative decoding (compute.speculative; same tokens, docs/speculative.md)")
    g.add_argument("--draft-tokens", type=int, help="most drafted tokens per verify pass")
    g.add_argument("--kv-bits", type=int, choices=[0, 4, 8],
                   help="attention keys and values at 4 or 8 bits: a long context in less "
                   "memory, the logits mlx-lm's with that cache (compute.kv_bits; default 0)")
    g.add_argument("--verify", choices=["off", "first-use", "full", "always"],
                   help="expert checksums: at first read (default), all at open, every read, or off")
    g.add_argument("--distributed", action="store_true", default=None,
                   help="run as one rank of an `mlx.launch` job: each rank holds a slice of "
                   "the layers with its own expert pool ([distributed] in the config)")
    g.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override any config key; repeatable")
    s = p.add_argument_group("sampling")
    for knob, kind in SAMPLING_FLAGS.items():
        s.add_argument("--" + knob.replace("_", "-"), type=kind, help=f"sampling.{knob}")
    s.add_argument("--stop", action="append", help="a stop string; repeatable")
    s.add_argument("--thinking", dest="enable_thinking", action=argparse.BooleanOptionalAction,
                   default=None, help="the chat template's thinking switch (chat.enable_thinking)")


# The `[sampling]` keys with a flag of their own (any other: `--set sampling.KEY=...`).
SAMPLING_FLAGS: dict[str, type] = {"temperature": float, "top_p": float, "top_k": int,
                                   "min_p": float, "seed": int, "max_tokens": int}

_FLAG_KEYS = {
    "memory_mb": ("memory", "budget_mb"),
    "pool_mb": ("pool", "budget_mb"),
    "slots": ("pool", "slots"),
    "strategy": ("prefetch", "strategy"),
    "depth": ("prefetch", "depth"),
    "eviction": ("pool", "eviction"),
    "readers": ("reader", "concurrency"),
    "prefill_chunk": ("compute", "prefill_chunk"),
    "speculative": ("compute", "speculative"),
    "draft_tokens": ("compute", "draft_tokens"),
    "kv_bits": ("compute", "kv_bits"),
    "verify": ("model", "verify"),
    **{knob: ("sampling", knob) for knob in SAMPLING_FLAGS},
    "enable_thinking": ("chat", "enable_thinking"),
    "distributed": ("distributed", "enabled"),
}


def engine_config(args: argparse.Namespace, model: str | None = None, *,
                  check_paths: bool = True) -> PipelineConfig:
    """The config file (if any), then the flags, validated as one config."""
    from pipeline.config.errors import ConfigError
    from pipeline.config.loading import config_from_dict, read_toml

    if getattr(args, "pool_mb", None) is not None and getattr(args, "slots", None) is not None:
        raise ConfigError("--pool-mb and --slots are exclusive: give one (or neither to size "
                          "the pool from available memory)")
    raw: dict[str, Any] = {}
    text = ""
    if args.config is not None:
        raw, text = read_toml(args.config)
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
    cfg = config_from_dict(raw, source=str(args.config or "<flags>"), text=text,
                           overrides=args.overrides, check_paths=check_paths)
    said = "log" in raw or any(o.strip().startswith("log.") for o in args.overrides)
    if said and getattr(args, "log_level", None) is None:  # the config's [log], unless --log-level
        from pipeline.logging_setup import configure_logging

        configure_logging(cfg.log.level, cfg.log.json or bool(getattr(args, "log_json", False)))
    return cfg


def distributed(cfg: PipelineConfig, face: Any, *, server: bool = False) -> int:
    """`face(cfg, stage)` on rank 0 of a distributed job, the stage loop on the others."""
    if cfg.distributed.gpu_per_rank:  # before anything below loads MLX
        from pipeline.distributed.gpu import pin_gpu_per_rank

        pin_gpu_per_rank()
    from pipeline.distributed.job import exit_now, run_distributed

    exit_now(run_distributed(cfg, face, stop_on_loss=server))
    return 1  # not reached


def check_outputs(cfg: PipelineConfig, trace: str | None) -> None:
    """The files `run` / `generate` will write, checked before the work that fills them."""
    from pathlib import Path

    from qpack.output_guard import check_output_file

    # A container packed on this first run makes its directories before any output is
    # written (the demo keeps its stats beside its container, under demo-data/).
    container = Path(cfg.model.path).absolute()
    made = [] if cfg.model.source is None or container.is_dir() else \
        [d for d in (container, *container.parents) if not d.exists()]
    for key, path in (("run.stats", cfg.run.stats), ("run.trace", trace or cfg.run.trace),
                      ("run.record_routing", cfg.run.record_routing)):
        if path is not None:
            check_output_file(path, key, made)


def _cmd_run(args: argparse.Namespace) -> int:
    import msgspec
    import trio

    from actors import timeline
    from pipeline.cli.console import run_pipeline
    from pipeline.config.errors import ConfigError
    from pipeline.prepare import ensure_container

    args.config = args.config_file
    try:
        cfg = engine_config(args, check_paths=False)
        if args.record_routing:
            cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(
                cfg.run, record_routing=args.record_routing))
        check_outputs(cfg, args.trace)  # before packing or loading anything
        if not cfg.distributed.enabled:  # ranks do not pack: one would race the others
            ensure_container(cfg.model)
    except (ConfigError, QpackError, FileNotFoundError, ValueError) as exc:
        return refused(exc)
    with timeline.recording(args.trace or cfg.run.trace):
        if cfg.distributed.enabled:
            return distributed(cfg, lambda c, s: trio.run(run_pipeline, c, args.trace, "run", s))
        return trio.run(run_pipeline, cfg, args.trace)


def _cmd_generate(args: argparse.Namespace) -> int:
    import msgspec
    import trio

    from pipeline.cli.console import run_pipeline
    from pipeline.config.errors import ConfigError
    from pipeline.config.schema import ChatMessage

    try:
        cfg = engine_config(args, args.model)
    except (ConfigError, ValueError) as exc:
        return refused(exc)
    try:
        texts = _prompts([*(args.prompt or []), *args.prompts] or ["Hello"])
    except ValueError as exc:
        return refused(exc)
    prompts: tuple[str | tuple[ChatMessage, ...], ...] = texts
    if args.chat or args.system is not None:  # each prompt one user turn, through the template
        system = () if args.system is None else (ChatMessage(role="system", content=args.system),)
        prompts = tuple((*system, ChatMessage(role="user", content=t)) for t in texts)
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(
        cfg.run, prompts=prompts, stats=args.stats, record_routing=args.record_routing))
    try:
        check_outputs(cfg, None)
    except QpackError as exc:
        return refused(exc)
    if cfg.distributed.enabled:
        return distributed(cfg, lambda c, s: trio.run(run_pipeline, c, None, "generate", s))
    return trio.run(run_pipeline, cfg, None, "generate")


def _prompts(given: list[str]) -> tuple[str, ...]:
    """`-` is the text on standard input (as mlx-lm's `--prompt -`), read once."""
    if "-" not in given:
        return tuple(given)
    import sys

    try:
        text = sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"prompt '-': standard input is not UTF-8 text ({exc.reason} at byte "
                         f"{exc.start})") from None
    if not text.strip():
        raise ValueError("prompt '-': standard input is empty")
    return tuple(text if p == "-" else p for p in given)


def _cmd_chat(args: argparse.Namespace) -> int:
    import trio

    from pipeline.cli.console import chat
    from pipeline.config.errors import ConfigError

    try:
        cfg = engine_config(args, args.model)
    except (ConfigError, ValueError) as exc:
        return refused(exc)
    if cfg.distributed.enabled:
        return distributed(cfg, lambda c, s: trio.run(chat, c, list(args.turns), s))
    return trio.run(chat, cfg, list(args.turns))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the pipeline a TOML config describes",
                       description="Pack the model on first use, then generate for every prompt "
                       "in [run] and print (and save) the measured stats.")
    p.add_argument("config_file", type=Path, metavar="CONFIG", help="e.g. config/demo.toml")
    p.add_argument("--trace", help="write a Chrome/Perfetto timeline JSON here")
    p.add_argument("--record-routing", help="save the routing trace here (for `replay`)")
    add_engine_flags(p, config_flag=False)
    p.set_defaults(func=_cmd_run)

    g = sub.add_parser("generate", help="one-shot generation from a container, with stats",
                       description="Stream a completion for each prompt and print tok/s, "
                       "pool hit rate and peak memory.")
    g.add_argument("model", help="path of a .qpack container")
    g.add_argument("prompts", nargs="*", metavar="PROMPT",
                   help="prompt text, as --prompt (after the --prompt ones); several run in "
                   "order; - reads standard input")
    g.add_argument("--prompt", action="append", help="prompt text (- reads standard input); repeatable")
    g.add_argument("--chat", action="store_true",
                   help="send each prompt as a user turn through the model's chat template "
                   "(default: the text as it is, a completion)")
    g.add_argument("--system", help="a system message before each prompt (implies --chat)")
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
