"""The routes are one table: `serve --help` and the metrics' labels are read from it."""

from __future__ import annotations

from pipeline.cli import build_parser
from pipeline.server.route_table import ROUTES, label, paths


def test_serve_help_lists_every_route() -> None:
    sub = next(a for a in build_parser()._actions if a.choices and "serve" in a.choices)
    text = " ".join(sub.choices["serve"].format_help().split())
    for spec in ROUTES:
        if "{" not in spec.path:
            assert f"{spec.method} {'/v1' if spec.v1 else ''}{spec.path} ({spec.help})" in text


def test_every_route_has_a_metrics_label_of_its_own_family() -> None:
    for spec in ROUTES:
        for path in paths(spec):
            concrete = path.replace("{model:path}", "tiny")
            got = label(concrete)
            assert got != "other" and (concrete == got or concrete.startswith(got + "/")), path
    assert label("/v1/messages/count_tokens") == "/v1/messages"
    assert label("/nowhere") == "other" and label("/api/chatter") == "other"
