"""The one failure a distributed job adds: a rank that is gone (light: the server imports it)."""

from __future__ import annotations


class RankLost(RuntimeError):
    """Another rank died or stopped answering. The job cannot go on: every rank exits.

    The server answers 503 to the request it cut short (the model is unavailable, not
    the request wrong); the CLI prints it as one `error:` line.
    """


class DistributedSetupError(ValueError):
    """The ranks of one job disagree (other containers, other configs), or no group."""
