"""Whether the cases that decode the default case's prompt the default's way gave its
tokens: the streamed forward is exact, so `serial`, `warm-all`, other readers, policies or
strategies must agree with `default` on every backend. Session 23 found every expert
pooled computing a wrong forward on CUDA (actors/pool/banks.py) only by checking this
by hand; the bench now says it for every run."""

from __future__ import annotations

from typing import Any


def _how(r: Any) -> tuple[Any, ...]:
    """What must match for the tokens to: the prompt, the length, who routes, no batch,
    no drafts, and the prompt's chunking (a GPU rounds a chunk's rows by its length)."""
    return (r.prompt_tokens, r.max_tokens, r.routing, r.concurrency, r.speculative,
            min(r.prefill_chunk or r.prompt_tokens, r.prompt_tokens))


def tokens_as_default(results: dict[str, Any]) -> dict[str, bool]:
    """Case name -> whether its tokens equal `default`'s, for the comparable cases."""
    default = results.get("default")
    if default is None or not default.token_ids:
        return {}
    return {name: r.token_ids == default.token_ids for name, r in results.items()
            if name != "default" and r.kind == "moestream" and r.token_ids
            and _how(r) == _how(default)}


def disagreement(report: dict[str, Any]) -> str | None:
    """One line naming the cases whose tokens part from the default's (None: none do)."""
    differ = [name for name, same in report.get("derived", {}).get("tokens_as_default", {}).items()
              if not same]
    if not differ:
        return None
    return ("bench: tokens differ from the default case's in " + ", ".join(differ)
            + " (the streamed forward is exact: a kernel or an engine bug; "
              "benchmarks/pool_exact_check.py compares greedy log-probabilities)")
