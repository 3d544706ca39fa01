"""How far a batched row's numbers drift from its lone run, on this machine's backend.

    python benchmarks/batch_logits_check.py MODEL [--rows 4] [--tokens 32] [--pool-mb P]

Greedy generations of `--rows` random prompts, first one at a time, then all at once (one
decode batch), with the top-5 log-probabilities of every generated token. Reported, per
row: whether the tokens are identical, the first position they differ at, and the largest
|difference| of the log-probabilities over the positions both runs share up to there
(the chosen token's and the top-5's, matched by token id), and, where the tokens part, how
far apart the lone run's top two log-probabilities were there (a near tie that a rounding
difference of that size can flip, or not). On MLX's CPU backend the
batched step computes each row bit for bit as alone (tests/test_batch.py); batched GEMMs
on a GPU may round differently, and this says by how much. Writes JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.sampling_params import SamplingParams  # noqa: E402
from pipeline.bench.spec import prompt_ids  # noqa: E402
from pipeline.config.loading import config_from_dict  # noqa: E402
from pipeline.events import Done, TextDelta  # noqa: E402

Run = tuple[list[int], list[dict[int, float]]]  # tokens; per position {token: logprob}


async def _one(engine: Any, prompt: list[int], tokens: int) -> Run:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=5)
    ids: list[int] = []
    probs: list[dict[int, float]] = []
    async for event in engine.generate(prompt, params):
        if isinstance(event, TextDelta):
            for entry in event.logprobs:
                probs.append({entry.token: entry.logprob, **dict(entry.top)})
        elif isinstance(event, Done):
            ids = list(event.token_ids)
    return ids, probs


def compare(alone: Run, batched: Run) -> dict[str, Any]:
    """Identical tokens?, the first differing position, max |Δ logprob| before it."""
    a_ids, a_p = alone
    b_ids, b_p = batched
    first = next((i for i, (x, y) in enumerate(zip(a_ids, b_ids, strict=False)) if x != y),
                 None if len(a_ids) == len(b_ids) else min(len(a_ids), len(b_ids)))
    upto = len(a_p) if first is None else first + 1  # the differing position's logits too
    delta = 0.0
    for pa, pb in zip(a_p[:upto], b_p[:upto], strict=False):
        for token in pa.keys() & pb.keys():
            delta = max(delta, abs(pa[token] - pb[token]))
    margin = None  # how close the lone run's top two were where the batched run flipped
    if first is not None and first < len(a_p):
        top = sorted(a_p[first].values(), reverse=True)
        margin = top[0] - top[1] if len(top) > 1 else None
    return {"identical": first is None, "first_difference": first,
            "max_abs_logprob_delta": delta, "alone_top2_margin_at_difference": margin}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from pipeline.engine import open_engine

    raw: dict[str, Any] = {"model": {"path": str(args.model)},
                           "compute": {"max_batch": args.rows}}
    if args.pool_mb:
        raw["pool"] = {"budget_mb": args.pool_mb}
    async with open_engine(config_from_dict(raw, source="<batch_logits_check>")) as engine:
        vocab = engine.facts.vocab_size
        prompts = [prompt_ids(args.prompt_tokens, vocab, args.seed + i) for i in range(args.rows)]
        alone = [await _one(engine, p, args.tokens) for p in prompts]
        batched: list[Run] = [([], [])] * args.rows

        async def row(i: int) -> None:
            batched[i] = await _one(engine, prompts[i], args.tokens)

        async with trio.open_nursery() as nursery:
            for i in range(args.rows):
                nursery.start_soon(row, i)
        import mlx.core as mx

        return {
            "model": str(args.model), "rows": args.rows, "tokens": args.tokens,
            "device": str(mx.default_device()), "host": platform.node(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "largest_batch": engine.largest_batch,
            "per_row": [compare(a, b) for a, b in zip(alone, batched, strict=True)],
        }


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--pool-mb", type=int, default=0, help="0: the config's default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    report = trio.run(main, args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    cli()
