"""`moestream`: one parser, one subcommand per face of the product.

Every module here only declares its arguments; what a subcommand runs is imported when
it runs, so `moestream --help` and argument errors never load MLX or the engine.
`main` turns whatever a command raises into one `error: <message>` line and exit 1
(pipeline.failures); Ctrl-C exits 130 and a closed stdout pipe 141, both quietly.
"""

from __future__ import annotations

import argparse
import sys

# First: a rank must learn which process started it before that one can be gone.
import pipeline.distributed.launcher_watch  # noqa: F401, I001
from pipeline.cli import bench, commands, config, launch, pack, replay, serve, synth
from pipeline.failures import EXIT_INTERRUPTED, broken_pipe, interrupted_by, report
from pipeline.logging_setup import configure_logging, debug_enabled

__all__ = ["build_parser", "main"]

# The order of `moestream --help`.
COMMAND_MODULES = (commands, serve, launch, bench, replay, pack, synth, config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moestream",
        description="Run huge sparse Mixture-of-Experts models with the experts streamed "
        "from disk into a bounded memory pool.",
    )
    parser.add_argument("--log-level", default=None,
                        help="debug, info, warning, error (default: a config's [log] level "
                        "when the file sets one, else warning)")
    parser.add_argument("--log-json", action="store_true", help="structured logs as JSON lines")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        module.register(sub)
    for command in sub.choices.values():  # after the subcommand too (`run c.toml --log-level debug`)
        command.add_argument("--log-level", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        command.add_argument("--log-json", action="store_true", default=argparse.SUPPRESS,
                             help=argparse.SUPPRESS)
    return parser


# Commands whose last positional list may also follow their options: its dest.
TRAILING = {"chat": "turns", "generate": "prompts"}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    trailing = TRAILING.get(args.command)
    if extra and trailing and not any(e.startswith("-") for e in extra):
        # argparse takes a positional list only before the options: `chat C --max-tokens 8 hi`
        setattr(args, trailing, [*getattr(args, trailing), *extra])
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    configure_logging(args.log_level or "warning", args.log_json)
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return broken_pipe()
    except BaseExceptionGroup as group:
        if interrupted_by(group, KeyboardInterrupt):
            return EXIT_INTERRUPTED
        if interrupted_by(group, BrokenPipeError):
            return broken_pipe()
        return report(group, debug_enabled())
    except Exception as exc:  # every failure: one line, the traceback only when debugging
        return report(exc, debug_enabled())


if __name__ == "__main__":
    sys.exit(main())
