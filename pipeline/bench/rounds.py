"""`moestream bench --rounds N`: the case list run N times, one round after the other.

A cold ratio from one run of each case moves with the disk: on one H100 lease (session 40)
four cold plain runs of the 35B gave 4.16-4.93 tok/s, so a speculating case's "x plain"
over the run beside it read 1.16-1.57 for the same configuration. Rounds interleave the
cases (plain, speculating, plain, ...), so a drift of the disk touches both sides of each
round alike, and a ratio is the median of the rounds' own. The first round's results keep
their names (every derived figure not about rounds is the first round's); round n > 1
names each result `case#n` (after any `@routing`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["round_name", "split_round", "tok_s_by_round"]


def round_name(name: str, n: int) -> str:
    """`name` as round `n` runs it (the first round's keeps it)."""
    return name if n <= 1 else f"{name}#{n}"


def split_round(name: str) -> tuple[str, str]:
    """(the first round's name, the round's suffix: "" or "#n")."""
    first, sep, n = name.rpartition("#")
    return (first, sep + n) if sep and n.isdigit() else (name, "")


def tok_s_by_round(results: dict[str, Any]) -> dict[str, list[float]]:
    """Each case run in more than one round: its decode tok/s, round by round."""
    out: dict[str, list[float]] = {}
    for name, r in results.items():
        out.setdefault(split_round(name)[0], []).append(r.decode_tok_s)
    return {name: runs for name, runs in out.items() if len(runs) > 1}
