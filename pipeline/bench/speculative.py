"""Bench cases for speculative decoding, and how the report shows them.

Random-weight bench models accept almost no real draft, so the cases that measure what
speculation gives draft from a reference run's own tokens, a seeded fraction corrupted
(`EmulatedDrafts`): acceptance a per token, labelled "emulated" everywhere. The
reference is the plain case of the same regime, run before (its tokens travel in the
case): `default` for a cold pool, `warm-all` for every expert pooled.

Names: `spec-k{K}-a{A}` (draft K tokens per pass, emulated acceptance A; cold, as
`default`), `spec-auto-a{A}` (the `auto` policy on those drafts), `spec-auto` /
`spec-ngram` (real prompt lookup on the bench prompt: what a text that does not repeat
costs), each also as `warm-spec-...` (every expert pooled, as `warm-all`).
Real MTP acceptance cannot be measured without trained weights: `spec-mtp` runs the
MTP drafter of a container that has the head, and reports what it accepts.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

_NAME = re.compile(r"^(?P<warm>warm-)?spec-(?P<mode>auto|ngram|mtp|k(?P<k>[1-8]))(?:-a(?P<a>0\.\d+|1\.0|1))?$")
ACCEPTANCES = ("0.5", "0.7", "0.8", "0.85")
EXAMPLES = (*(f"spec-k{k}-a{a}" for k in (1, 2, 3) for a in ACCEPTANCES),
            *(f"spec-auto-a{a}" for a in ACCEPTANCES), "spec-auto", "spec-ngram", "spec-mtp")


def is_spec_case(name: str) -> bool:
    return _NAME.match(name) is not None


def reference_of(name: str) -> str:
    """The plain case whose tokens the emulated drafts come from (and it is compared to)."""
    m = _NAME.match(name)
    assert m is not None
    return "warm-all" if m["warm"] else "default"


def reference_name(name: str) -> str:
    """The name of the plain run a speculating case `name` (with any `@routing` and
    `#round`) drafts from and is compared with: its reference of the same routing and round."""
    from pipeline.bench.rounds import split_round

    first, rnd = split_round(name)
    base, at, routing = first.partition("@")
    return reference_of(base) + at + routing + rnd


def spec_case_fields(name: str, base: dict[str, Any]) -> dict[str, Any]:
    """Case fields for `name`: its config over `base` and its speculation."""
    m = _NAME.match(name)
    assert m is not None, name
    mode = "ngram" if m["k"] else m["mode"]
    compute = {**base.get("compute", {}), "speculative": mode,
               "draft_tokens": int(m["k"]) if m["k"] else 3}
    return {"config": {**base, "compute": compute}, "warm_all": bool(m["warm"]),
            "emulate": float(m["a"]) if m["a"] else None, "reference": reference_of(name)}


def spec_result_fields(stats: Any, case: Any) -> dict[str, Any]:
    """What a speculating case measured (GenerationStats -> Result fields)."""
    return {"speculative": stats.speculative, "emulated_acceptance": case.emulate,
            "draft_tokens": int(case.config.get("compute", {}).get("draft_tokens", 0)),
            "verify_passes": stats.verify_passes, "drafts_proposed": stats.drafts_proposed,
            "drafts_accepted": stats.drafts_accepted, "tokens_per_pass": stats.tokens_per_pass,
            "acceptance": stats.drafts_accepted / stats.drafts_proposed if stats.drafts_proposed else 0.0}


def spec_derived(results: dict[str, Any]) -> dict[str, Any]:
    """Each speculating case's decode tok/s over plain decode's ("x plain"): a warm case's
    median of its (plain, speculative) pairs in one engine (`bench/warm_pairs.py`), its
    one run over the reference case's beside it (`_single_over_plain`); a cold case's
    one run over its reference's. Run in rounds (`bench/rounds.py`), a round's ratio is
    over its own round's reference, the case's the median of its rounds' (listed in
    `_over_plain_rounds`)."""
    from pipeline.bench.rounds import split_round
    from pipeline.bench.warm_pairs import Pairs

    out: dict[str, Any] = {}
    by_round: dict[str, list[float]] = {}
    for name, r in results.items():
        first, rnd = split_round(name)
        if not is_spec_case(first.partition("@")[0]):
            continue
        ref = results.get(reference_name(name))
        single = r.decode_tok_s / ref.decode_tok_s if ref is not None and ref.decode_tok_s > 0 else None
        ratio = single
        if r.paired_plain_tok_s:
            ratio = Pairs(r.paired_spec_tok_s, r.paired_plain_tok_s, "plain").ratio
            if single is not None and not rnd:
                out[f"{first}_single_over_plain"] = single
        if ratio is not None:
            by_round.setdefault(first, []).append(ratio)
    for first, ratios in by_round.items():
        out[f"{first}_over_plain"] = statistics.median(ratios)
        if len(ratios) > 1:
            out[f"{first}_over_plain_rounds"] = ratios
    return out


def speculation_table(report: dict[str, Any]):  # -> rich.table.Table | None
    """One row a speculating case; run in rounds, its medians and each round's ratio."""
    from rich.table import Table

    from pipeline.bench.rounds import split_round

    rows = [r for r in report["results"] if not r.get("error") and r.get("speculative", "off") != "off"
            and not split_round(r["name"])[1]]
    if not rows:
        return None
    derived = report.get("derived", {})
    tok_s = derived.get("decode_tok_s_rounds", {})
    table = Table(title="speculative decoding (emulated: drafts from the plain run's tokens, "
                  "a fraction corrupted; not a real drafter's acceptance)")
    cols = ["case", "mode", "drafts", "emulated a", "decode tok/s", "x plain", "acceptance",
            "tokens/pass", "passes"]
    if tok_s:
        cols[4:6] = ["decode tok/s (median)", "x plain (median)", "x plain by round"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("case", "mode") else "right")
    for r in rows:
        a = r.get("emulated_acceptance")
        ratio = derived.get(f"{r['name']}_over_plain")
        runs = tok_s.get(r["name"], [r["decode_tok_s"]])
        cells = [r["name"], r["speculative"], str(r.get("draft_tokens", "")),
                 "-" if a is None else f"{a:.2f}", f"{statistics.median(runs):.2f}",
                 "-" if ratio is None else f"{ratio:.2f}x"]
        if tok_s:
            cells.append(" ".join(f"{x:.2f}" for x in derived.get(f"{r['name']}_over_plain_rounds", [])))
        table.add_row(*cells, f"{r.get('acceptance', 0):.2f}", f"{r.get('tokens_per_pass', 0):.2f}",
                      str(r.get("verify_passes", 0)))
    return table


def with_references(cases: list[Any]) -> list[Any]:
    """`cases`, each emulated speculative case preceded by its plain reference (added,
    as configured, when not asked for): its tokens are the drafts' source."""
    out: list[Any] = []
    names = {c.name for c in cases}
    for case in sorted(cases, key=lambda c: c.emulate is not None):  # references first
        if case.emulate is not None:
            ref = reference_name(case.name)
            if ref not in names:
                names.add(ref)
                plain = {**case.config, "compute": {**case.config.get("compute", {}),
                                                    "speculative": "off"}}
                out.append(type(case)(name=ref, model=case.model, config=plain,
                                      prompt_tokens=case.prompt_tokens, max_tokens=case.max_tokens,
                                      cold=case.cold, seed=case.seed, warm_all=case.warm_all,
                                      routing=case.routing))
        out.append(case)
    return out
