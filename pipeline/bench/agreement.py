"""Whether the cases that decode the default case's prompt the default's way gave its
tokens: the streamed forward is exact, so `serial`, `warm-all`, other readers, policies or
strategies must agree with `default` on every backend. Session 23 found every expert
pooled computing a wrong forward on CUDA (actors/pool/banks.py) only by checking this
by hand; the bench now says it for every run."""

from __future__ import annotations

from typing import Any


def _how(r: Any, drafts: bool = True) -> tuple[Any, ...]:
    """What must match for the tokens to: the prompt, the length, who routes, no batch,
    the prompt's chunking (a GPU rounds a chunk's rows by its length), and (`drafts`)
    the same speculation (the default's tokens are compared with no drafter's)."""
    return (r.prompt_tokens, r.max_tokens, r.routing, r.concurrency,
            min(r.prefill_chunk or r.prompt_tokens, r.prompt_tokens),
            *((r.speculative,) if drafts else ()))


def tokens_as_default(results: dict[str, Any]) -> dict[str, bool]:
    """Case name -> whether its tokens equal `default`'s, for the comparable cases."""
    default = results.get("default")
    if default is None or not default.token_ids:
        return {}
    return {name: r.token_ids == default.token_ids for name, r in results.items()
            if name != "default" and r.kind == "moestream" and r.token_ids
            and _how(r) == _how(default)}


def tokens_as_reference(results: dict[str, Any]) -> dict[str, bool]:
    """Speculating case name -> whether its tokens equal its plain reference's of the same
    round and routing (`default` or `warm-all`): greedy verification keeps exactly what
    plain decode draws, whatever the drafts (the bench decodes greedily)."""
    from pipeline.bench.rounds import split_round
    from pipeline.bench.speculative import is_spec_case, reference_name

    out: dict[str, bool] = {}
    for name, r in results.items():
        if not is_spec_case(split_round(name)[0].partition("@")[0]) or not r.token_ids:
            continue
        ref = results.get(reference_name(name))
        if ref is not None and ref.token_ids and _how(r, drafts=False) == _how(ref, drafts=False):
            out[name] = r.token_ids == ref.token_ids
    return out


def disagreement(report: dict[str, Any]) -> str | None:
    """One line naming the cases whose tokens part from the default's, or a speculating
    case's from its plain reference's (None: none do)."""
    derived = report.get("derived", {})
    differ = [name for key in ("tokens_as_default", "tokens_as_reference")
              for name, same in derived.get(key, {}).items() if not same]
    if not differ:
        return None
    return ("bench: tokens differ from the default case's (a speculating case's: its plain "
            "run's) in " + ", ".join(differ)
            + " (the streamed forward is exact: a kernel or an engine bug; "
              "benchmarks/pool_exact_check.py compares greedy log-probabilities)")
