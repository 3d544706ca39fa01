"""What each rank of the exactness test runs, and what the test compares.

`collect(engine)` gives the logits of a prompt (in chunks, one all-positions chunk) and
of decode steps, greedy tokens, a follow-up turn that starts from the prefix cache, and
the tokens and log-probabilities of generations that share a decode batch (staggered
joins, a leaver, a cancel; one restarts from a cached prefix): run in the test's own process
on the whole model, and by rank 0 of a distributed job (`exact_job`) on its slice, they
must be identical.
"""

from __future__ import annotations

import os
from contextlib import aclosing
from pathlib import Path
from typing import Any

import numpy as np
import trio
from helpers_engine import engine_config, forward_logits, generate

from actors.sampling_params import SamplingParams
from pipeline.events import Done, TextDelta

PROMPT = [11, 400, 7, 1023, 5]
DECODE = [42, 7000, 3]
GREEDY = 6
BATCHED = {"a": PROMPT, "b": [5, 6, 7], "c": [300, 301, 302, 303], "d": [9, 8, 77]}


async def batched(engine: Any) -> dict[str, np.ndarray]:
    """a and b start together; c joins once a has 2 tokens, d once b has, and d is
    cancelled after 2 of its own; b stops first (fewer tokens). Each finished row's token
    ids, log-probabilities and cached prompt tokens."""
    out: dict[str, np.ndarray] = {}
    a2, b2 = trio.Event(), trio.Event()

    async def run(name: str, tokens: int, after: trio.Event | None = None,
                  seen: trio.Event | None = None, cancel_at: int | None = None) -> None:
        if after is not None:
            await after.wait()
        params = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=2)
        got, probs = 0, []
        with trio.CancelScope() as scope:
            async with aclosing(engine.generate(BATCHED[name], params)) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        probs += [e.logprob for e in event.logprobs]
                        got += len(event.logprobs)
                        if seen is not None and got >= 2:
                            seen.set()
                        if cancel_at is not None and got >= cancel_at:
                            scope.cancel()
                    elif isinstance(event, Done):
                        out[f"batch_{name}_ids"] = np.array(event.token_ids)
                        out[f"batch_{name}_logprobs"] = np.array(probs)
                        out[f"batch_{name}_cached"] = np.array(event.stats.cached_tokens)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "a", GREEDY + 4, None, a2)
        nursery.start_soon(run, "b", GREEDY - 2, None, b2)
        nursery.start_soon(run, "c", GREEDY, a2)
        nursery.start_soon(run, "d", GREEDY, b2, None, 2)
    assert "batch_d_ids" not in out  # cancelled
    return out


async def collect(engine: Any) -> dict[str, np.ndarray]:
    out = {f"step{i}": x for i, x in enumerate(await forward_logits(engine, PROMPT, DECODE))}
    cache = engine._core.model.make_cache()
    async with engine._core.lock:
        every = await engine._core.compute.forward(PROMPT[:2], cache, "prefill", all_positions=True)
        out["every"] = await engine._core.worker.run(np.array, every)
    done = await generate(engine, PROMPT, GREEDY)
    out["greedy"] = np.array(done.token_ids)
    out["text"] = np.array(done.text)
    # A follow-up turn: it starts from the state the first generation left (prefix cache).
    follow = await generate(engine, [*PROMPT, *done.token_ids, 77], 3)
    out["follow"] = np.array(follow.token_ids)
    out["follow_cached"] = np.array(follow.stats.cached_tokens)
    out.update(await batched(engine))
    return out


async def collect_greedy(engine: Any) -> dict[str, np.ndarray]:
    """The lighter comparison: the prompt's and decode steps' logits and greedy tokens."""
    out = {f"step{i}": x for i, x in enumerate(await forward_logits(engine, PROMPT, DECODE))}
    out["greedy"] = np.array((await generate(engine, PROMPT, GREEDY)).token_ids)
    return out


def greedy_job(path: str, out_dir: str) -> int:
    """One rank of a job that only compares logits and greedy tokens (`collect_greedy`);
    rank 0 also saves which layers it ran."""
    from pipeline.distributed.job import run_distributed
    from pipeline.engine import open_engine

    async def rank0(cfg: Any, stage: Any) -> int:
        async with open_engine(cfg, stage=stage) as engine:
            np.savez(Path(out_dir) / "greedy.npz", **await collect_greedy(engine),
                     layers=np.array(list(engine._core.model.layers)))
        return 0

    return run_distributed(config(Path(path)), lambda c, s: trio.run(rank0, c, s))


def config(path: Path, distributed: bool = True, slots: int = 8) -> Any:
    return engine_config(path, pool={"slots": slots}, distributed={"enabled": distributed})


def generate_argv(path: Path) -> list[str]:
    return ["generate", str(path), "--prompt", "Hello there", "--max-tokens", "6",
            "--temperature", "0", "--slots", "8", "--prefill-chunk", "2"]


def exact_job(paths: list[str], out_dir: str) -> int:
    """One rank: for each container, join, run (rank 0 collects), finish together; then
    `moestream generate --distributed` on the first (the CLI face, in the same processes)."""
    from mlx.utils import tree_flatten

    from pipeline.distributed.job import run_distributed
    from pipeline.engine import open_engine

    async def rank0(cfg: Any, stage: Any, dest: Path) -> int:
        async with open_engine(cfg, stage=stage) as engine:
            np.savez(dest, **await collect(engine))
            parts = engine._core.model.parts
            others = [p for i in range(len(parts.layers)) if i not in engine._core.model.layers
                      for _, p in tree_flatten(parts.layers[i].parameters())]
            np.savez(dest.with_suffix(".stats.npz"), slots=engine._core.router.table.num_slots,
                     layers=np.array(list(engine._core.model.layers)),
                     other_layers_elements=sum(p.size for p in others) + parts.norm.weight.size,
                     dense_bytes=stage.dense_bytes,
                     ranks_on_host=stage.ranks_on_host,
                     largest_batch=engine.largest_batch,
                     max_batch=engine.max_batch, top_k=engine.facts.top_k,
                     container_dense_bytes=engine.container.manifest.dense_bytes)
        return 0

    # Rank 0's pool could pin a batch twice as large as the others': the ranks agree on
    # the batch their smallest pool can pin.
    slots = 16 if os.environ.get("MLX_RANK") == "0" else 8
    for path in paths:
        cfg = config(Path(path), slots=slots)
        dest = Path(out_dir) / f"{Path(path).parent.name}.npz"
        status = run_distributed(cfg, lambda c, s, dest=dest: trio.run(rank0, c, s, dest))
        if status:
            return status
    from pipeline.cli import main

    return main([*generate_argv(Path(paths[0])), "--distributed"])
