"""CUDA graph commits per decode token: the engine with every expert pooled against resident
mlx-lm, the same container, one process (issue 31's warm-all gap).

MLX's CUDA backend writes one DOT file per graph it commits when
`MLX_SAVE_CUDA_GRAPHS_DOT_FILE` names a file prefix, so the files a phase adds are the
graphs it committed, and their kernel nodes the work in them. Each side generates 2 tokens
(prefill and the first token: compiles, graphs instantiated) and then 2 + TOKENS; the
difference over TOKENS is one decode token's commits and kernels. Run it under the limits
to compare (`MLX_MAX_MB_PER_BUFFER`, `MLX_MAX_OPS_PER_BUFFER`): a graph commits when it
passes either.

    python benchmarks/graph_commits.py CONTAINER DIR [TOKENS]
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT, OUT = Path(sys.argv[1]), Path(sys.argv[2])
TOKENS = int(sys.argv[3]) if len(sys.argv) > 3 else 4
OUT.mkdir(parents=True, exist_ok=True)
for old in OUT.glob("g*"):
    old.unlink()
os.environ["MLX_SAVE_CUDA_GRAPHS_DOT_FILE"] = str(OUT / "g")  # before MLX's first graph


def dumped() -> set[str]:
    return {p.name for p in OUT.glob("g*")}


def nodes(names: set[str]) -> list[str]:
    """The dumped graphs' nodes, each as its label's second line (cudaGraphDebugDotPrint
    writes "N\\n<what>": a kernel's mangled name, EMPTY, or the child graph's name)."""
    out: list[str] = []
    for n in names:
        for label in re.findall(r'label="(\d+)\n(.*?)\n"\]', (OUT / n).read_text(errors="replace"), re.S):
            out.append(label[1])
    return out


def kernels(found: list[str]) -> int:
    """Kernel nodes among `nodes`' (not EMPTY, not a child graph's node)."""
    return sum(1 for k in found if k != "EMPTY" and not k.startswith("graph_"))


def labels(found: list[str]) -> Counter[str]:
    """Which kernels (and nodes of other kinds) `nodes` holds, numbers dropped."""
    return Counter("graph" if k.startswith("graph_") else re.sub(r"\d+", "#", k)[:160] for k in found)


def per_token(run: Callable[[int], None]) -> dict[str, object]:
    """One decode token's commits, kernels and kernels by name: a 2+TOKENS run less a
    2-token run, over TOKENS; each run's dumps read once."""
    before = dumped()
    run(2)
    short = dumped() - before
    run(2 + TOKENS)
    long = dumped() - before - short
    short_nodes, long_nodes = nodes(short), nodes(long)
    return {"commits_per_token": (len(long) - len(short)) / TOKENS,
            "kernels_per_token": (kernels(long_nodes) - kernels(short_nodes)) / TOKENS,
            "commits_2_tokens": len(short),
            "labels_per_token": {k: round(v / TOKENS, 2)
                                 for k, v in (labels(long_nodes) - labels(short_nodes)).most_common(60)},
            "a_graph": (OUT / max(long, key=lambda n: (OUT / n).stat().st_size)).read_text()[:6000] if long else ""}


def main() -> None:
    import mlx.core as mx
    import trio
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from actors.sampling_params import SamplingParams
    from pipeline.bench.refs import resident_model
    from pipeline.bench.spec import Case, engine_dict, prompt_ids
    from pipeline.bench.warm_pairs import finished
    from pipeline.config.loading import config_from_dict
    from pipeline.engine import open_engine

    case = Case(name="warm-all", model=str(ROOT), warm_all=True, cold=False)
    cfg = config_from_dict(engine_dict(case), source="<graph_commits>")
    out: dict[str, object] = {"limits": {k: v for k, v in os.environ.items() if k.startswith("MLX_MAX")}}

    async def engine_side() -> None:
        async with open_engine(cfg) as engine:
            await engine.warm()
            prompt = prompt_ids(16, engine.facts.vocab_size, 0)
            await finished(engine, prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=2))

            def run(n: int) -> None:
                trio.from_thread.run(finished, engine, prompt, SamplingParams(temperature=1.0, seed=0, max_tokens=n))

            out["engine"] = await trio.to_thread.run_sync(per_token, run)
            out["vocab"] = engine.facts.vocab_size

    trio.run(engine_side)
    model, _, _ = resident_model(ROOT)
    prompt = prompt_ids(16, int(out["vocab"]), 0)  # type: ignore[call-overload]
    sampler = make_sampler(temp=1.0)

    def resident(n: int) -> None:
        mx.random.seed(0)
        for _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=sampler):
            pass

    resident(2)
    out["resident"] = per_token(resident)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
