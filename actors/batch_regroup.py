"""The cache operations of a decode batch's regroup, between two steps.

One function, so that every process holding a part of the batch's state does the same
operations in the same order: the decode batch (`actors/decode_batch.py`), and a later
pipeline rank, which learns of a regroup only from the rows' ids before and after
(`pipeline/distributed/worker.py`). Rows that stay keep their order; newcomers are
appended. A batch of two or more rows has merged caches; one row has its own plain ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actors.forward import CacheBatcher


def regroup_caches(ops: CacheBatcher, batch: list[Any] | None, rows: int, keep: Sequence[int],
                   joining: Sequence[list[Any]], copies: Sequence[int] = ()
                   ) -> tuple[list[Any] | None, dict[int, list[Any]]]:
    """The caches after a regroup, and the plain caches taken out of the batch.

    `batch`: the rows' caches before (merged when `rows` > 1, the one row's own when 1,
    None when 0); `keep`: the indices of the rows that stay, in order; `joining`: the
    newcomers' own caches; `copies`: leaving rows whose caches are copied out (a finished
    sequence's state for the prefix cache).

    Returns the new caches (merged for two or more rows, the one row's own, None for
    none) and {row index: its own caches} for the copies and, when one row stays alone
    out of a merged batch, for that row (the batch's caches are then left behind).
    """
    taken: dict[int, list[Any]] = {}
    merged = rows > 1
    if merged:
        assert batch is not None
        for i in copies:
            taken[i] = ops.extract(batch, i)
        if len(keep) == 1:
            taken[keep[0]] = ops.extract(batch, keep[0])
        elif 1 < len(keep) < rows:
            ops.keep(batch, keep)
    if len(keep) > 1:  # they stay in the merged caches; newcomers are appended
        assert batch is not None
        if joining:
            ops.extend(batch, list(joining))
        return batch, taken
    # At most one row stays: out of a merged batch it was taken above; every row may
    # also be leaving while newcomers join (then nothing stays).
    kept = (taken[keep[0]] if merged else batch) if keep else None
    staying = [kept] if kept is not None else []
    members = [*staying, *joining]
    if not members:
        return None, taken
    if len(members) == 1:
        return members[0], taken
    return ops.merge(members), taken
