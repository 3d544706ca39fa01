"""`moestream`: one parser, one subcommand per face of the product."""

from __future__ import annotations

import argparse
import sys

from pipeline.logging_setup import configure_logging

# Each module adds its own subcommands (see its `register`).
COMMAND_MODULES = (
    "pipeline.commands",
    "pipeline.server_cli",
    "pipeline.bench_cli",
    "pipeline.replay",
    "qpack.pack_cli",
    "qpack.synth_cli",
    "pipeline.config",
)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="moestream",
        description="Run huge sparse Mixture-of-Experts models with the experts streamed "
        "from disk into a bounded memory pool.",
    )
    parser.add_argument("--log-level", default="warning", help="debug, info, warning, error")
    parser.add_argument("--log-json", action="store_true", help="structured logs as JSON lines")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_json)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
