"""`moestream config FILE`: validate a pipeline config and print the effective settings."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="validate a pipeline config and print the effective settings",
        description="Load a TOML pipeline config, apply --set overrides, validate every key, "
        "and print the effective config (all defaults filled in) as TOML.",
    )
    p.add_argument("path", type=Path, help="the TOML config file, e.g. config/demo.toml")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key (TOML value syntax; bare words are strings); repeatable",
    )
    p.add_argument(
        "--no-check-paths", action="store_true", help="do not require model.path to exist"
    )
    p.set_defaults(func=_cmd_config)


def _cmd_config(args: argparse.Namespace) -> int:
    from pipeline.config.errors import ConfigError
    from pipeline.config.loading import load_config

    try:
        cfg = load_config(args.path, args.overrides, check_paths=not args.no_check_paths)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(cfg.to_toml(), end="")
    return 0
