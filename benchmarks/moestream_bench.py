"""`moestream bench` / `bench-container` without the rest of the CLI (whose server
dependencies a bare GPU host may lack): `python benchmarks/moestream_bench.py bench ...`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.cli import bench as bench_cli  # noqa: E402
from pipeline.logging_setup import configure_logging  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moestream")
    parser.add_argument("--log-level", default="warning")
    sub = parser.add_subparsers(dest="command", required=True)
    bench_cli.register(sub)
    args = parser.parse_args(argv)
    configure_logging(args.log_level, False)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
