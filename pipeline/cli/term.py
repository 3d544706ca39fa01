"""Where the CLI writes for people: stderr, wide enough for the stats table in CI logs."""

from __future__ import annotations

from rich.console import Console

err = Console(stderr=True, width=160)
