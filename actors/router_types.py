"""What the router's callers see besides the router (actors/router.py): an install, the
router's counters, and the error a token waiting on the GPU meets when no buffer is free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Install = tuple[int, Any]  # (slot, blob: a staging buffer or the MLX array staged from it)


class PullStarved(RuntimeError):
    """A demand of a token waiting on the GPU found every staging buffer held by installs
    the GPU has not pulled yet (actors/device_wait.py): that token is redone per layer."""


@dataclass
class RouterStats:
    stall_seconds: float = 0.0
    prefetch_hits_waited: int = 0
    # The stall split by the load that ended it (the last of the layer's to land): one
    # a prefetch had ordered but that came late, or one no prediction asked for.
    stall_late_seconds: float = 0.0
    stall_unpredicted_seconds: float = 0.0
    # Landing reads whose key was evicted before they landed (they wrote nothing).
    landings_abandoned: int = 0
    # Shelved predictions (actors/shelf.py) whose key was evicted before any read.
    shelved_dropped: int = 0
    # Installs a token waiting on the GPU made as copies the GPU pulled (actors/device_wait.py).
    pulled: int = 0
    # ... of them listed as their read ended, between two demands (`ExpertRouter._read_done`).
    pulled_early: int = 0
