"""The prefix cache across ranks: an entry is every rank's state after the same tokens.

Rank 0 decides (`StagePrefixCache`, the engine's prefix cache there): which states to
keep, which to hand out, which to drop. Each decision about an entry becomes a command
for the later ranks, queued and sent in front of the next forward (`Stage.exchange`), so
every rank sees them in rank 0's order and before the forward that relies on them:
- `KEEP key seq`: a sequence is done; its state becomes entry `key` (a row of the decode
  batch is copied out of it, as rank 0 copied it; the batch cuts the row at its regroup);
- `SNAPSHOT key seq`: a copy of a prefilling sequence's state becomes entry `key`;
- `RESTORE key seq`: a new sequence starts from a copy of entry `key`;
- `DROP key`: the entry is gone (evicted, replaced).
A later rank applies them with `PrefixMirror` and passes them on; nothing comes back.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.distributed import wire
from pipeline.distributed.model import new_seq, seqs_of, with_seqs
from pipeline.prefix_cache import PrefixCache, snapshot

if TYPE_CHECKING:
    from pipeline.models.batch_caches import BatchCaches


class StagePrefixCache(PrefixCache):
    """Rank 0's prefix cache: its own layers' states, and commands for the later ranks'."""

    def __init__(self, max_bytes: int, max_entries: int, interval: int) -> None:
        super().__init__(max_bytes, max_entries, interval)
        self.ids: dict[tuple[int, ...], int] = {}
        self._ids = itertools.count(1)
        # Every call comes on the MLX thread (the prefix cache's rule; `Stage.exchange`
        # too), so these need no lock.
        self._pending: list[np.ndarray] = []
        self._copying_from: int | None = None  # checkpoint: the sequence copied

    def _send(self, command: wire.Command, key: int, seq: int = 0) -> None:
        self._pending.append(wire.Header(command, seq, key=key).encode())

    def take_pending(self) -> list[np.ndarray]:
        """The commands to send in front of the next forward (Stage.exchange)."""
        pending, self._pending = self._pending, []
        return pending

    def _dropped(self, before: set[tuple[int, ...]]) -> None:
        for key in before - self._entries.keys():
            self._send(wire.Command.DROP, self.ids.pop(key))

    def put(self, tokens: Sequence[int], cache: list[Any]) -> None:
        seq = self._copying_from
        how = wire.Command.KEEP if seq is None else wire.Command.SNAPSHOT
        if seq is None:
            seq = seqs_of(cache)[0]
        before = set(self._entries)
        super().put(tokens, cache)
        key = tuple(tokens)
        stored = self._entries.get(key)
        if stored is not None and stored[0] is cache:
            if key in before:  # replaced: the later ranks' old state goes with it
                self._send(wire.Command.DROP, self.ids.pop(key))
                before.discard(key)
            self.ids[key] = next(self._ids)
            self._send(how, self.ids[key], seq)
        self._dropped(before)

    def checkpoint(self, tokens: Sequence[int], cache: list[Any]) -> None:
        self._copying_from = seqs_of(cache)[0]
        try:
            super().checkpoint(tokens, cache)
        finally:
            self._copying_from = None

    def take(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        before = set(self._entries)
        cache, n = super().take(tokens)
        if cache is None:
            return None, 0
        seq = new_seq()  # a new sequence on every rank, starting from the entry's state
        self._send(wire.Command.RESTORE, self.ids[tuple(tokens[:n])], seq)
        self._dropped(before)  # handed out itself (a cache kind snapshot cannot copy)
        return with_seqs(cache, [seq]), n

    def clear(self) -> None:
        before = set(self._entries)
        super().clear()
        self._dropped(before)


class PrefixMirror:
    """A later rank's entries, kept in step with rank 0's by its commands."""

    def __init__(self) -> None:
        self.entries: dict[int, list[Any]] = {}

    def apply(self, header: wire.Header, caches: dict[int, list[Any]],
              batch: list[Any] | None, ops: BatchCaches) -> None:
        """On the MLX thread: one command, on this rank's sequences' `caches` (plain, by
        id) and the decode `batch` (merged rows, ids by `seqs_of`)."""
        command, key, seq = header.command, header.key, header.seq
        if command == wire.Command.DROP:
            self.entries.pop(key, None)
        elif command == wire.Command.RESTORE:
            caches[seq] = with_seqs(snapshot(self.entries[key]), [seq])
        elif command == wire.Command.SNAPSHOT:
            self.entries[key] = snapshot(caches[seq])
        elif command == wire.Command.KEEP:
            rows = seqs_of(batch) if batch is not None else []
            if seq in rows:
                # (`seq in rows` means there is a batch: `rows` is empty without one)
                self.entries[key] = ops.extract(batch, rows.index(seq))  # type: ignore[arg-type]
            else:
                self.entries[key] = caches.pop(seq)
