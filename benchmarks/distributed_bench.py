"""One process vs pipeline-parallel ranks at the same per-rank pool (docs/distributed.md).

    # one process, pool P (and 2P for the hit-rate target):
    python benchmarks/distributed_bench.py MODEL --pool-mb P --out one.json
    # N ranks, pool P each (every rank runs the same command):
    mlx.launch -n 2 --backend ring -- python benchmarks/distributed_bench.py MODEL \\
        --pool-mb P --distributed --out two.json

Runs greedy generations of `--prompts` random prompts (a fixed seed: the same tokens for
every run), one after another or (`--concurrent`) all at once in one decode batch, and
reports decode tok/s (with `--concurrent` the aggregate over the wall time), the pool hit
rate and bytes read per token over all ranks, and the boundary: rank 0's wait per decode
forward less the later ranks' work on it (what crossing costs per token; a batch step is
one forward for all its rows), and a ping-pong of exactly the boundary's messages
(header + [1, 1, hidden] on, [vocab] logits back) with no model work at all.
`--gpu-per-rank`: rank r uses GPU r only (CUDA_VISIBLE_DEVICES=r, set before MLX loads).
Writes JSON (rank 0) and prints it.
"""

from __future__ import annotations

import os
import sys

if "--gpu-per-rank" in sys.argv:  # before anything imports MLX
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("MLX_RANK", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import trio  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.sampling_params import SamplingParams  # noqa: E402
from pipeline.config.loading import config_from_dict  # noqa: E402
from pipeline.config.schema import PipelineConfig
from pipeline.events import Done, TextDelta  # noqa: E402
from pipeline.logging_setup import configure_logging  # noqa: E402


def _config(args: argparse.Namespace) -> PipelineConfig:
    return config_from_dict({
        "model": {"path": args.model, "verify": "off"},
        "pool": {"budget_mb": args.pool_mb},
        "compute": {"prefill_chunk": args.prefill_chunk, "run_ahead": args.run_ahead},
        "prefetch": {"strategy": args.strategy},
        "reader": {"o_direct": args.o_direct},
        "distributed": {"enabled": args.distributed},
    })


def _prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    return [[int(t) for t in rng.integers(1000, min(vocab, 100_000), args.prompt_tokens)]
            for _ in range(args.prompts)]


async def _generate(args: argparse.Namespace, cfg: PipelineConfig,
                    stage: Any = None) -> dict[str, Any]:
    from pipeline.engine import open_engine

    async with open_engine(cfg, stage=stage) as engine:
        vocab = engine.facts.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        before = engine.counters()
        runs: list[Any] = []
        first_token: list[float] = []  # when the run's first token came

        async def one(prompt: list[int]) -> None:
            async for event in engine.generate(prompt, params):
                if isinstance(event, TextDelta) and event.token_ids and not first_token:
                    first_token.append(time.perf_counter())
                elif isinstance(event, Done):
                    runs.append(event.stats)

        prompts = _prompts(args, vocab)
        if args.concurrent:  # one decode batch (across the ranks, when distributed)
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for prompt in prompts:
                    nursery.start_soon(one, prompt)
            # Wall time: from the first token to the last generation's end.
            decode_s = time.perf_counter() - (first_token[0] if first_token else start)
        else:
            for prompt in prompts:
                await one(prompt)
            decode_s = sum(max(s.completion_tokens - 1, 0) / s.decode_tok_s
                           for s in runs if s.decode_tok_s)
        decoded = sum(max(s.completion_tokens - 1, 0) for s in runs)
        snap, spent = engine.pool_snapshot(), engine.counters() - before
        return {
            "concurrent": args.concurrent,
            "largest_batch": engine.largest_batch,
            "decode_tok_s": decoded / decode_s if decode_s else 0.0,
            "per_sequence_decode_tok_s": float(np.mean([s.decode_tok_s for s in runs])),
            "prefill_tok_s": float(np.mean([s.prefill_tok_s for s in runs])),
            "rank0_hit_rate": float(np.mean([s.hit_rate for s in runs])),
            "tokens": sum(s.prompt_tokens + s.completion_tokens for s in runs),
            "decode_tokens": decoded,
            "decode_s": decode_s,
            "slots_rank0": snap["slots"],
            "pool_mb_rank0": snap["pool_bytes"] / 2**20,
            "hits": spent.hits, "misses": spent.misses, "bytes_read": spent.bytes_read,
        }


def _ping(stage: Any, rounds: int) -> float | None:
    """Mean seconds of one boundary round trip with no model work (rank 0's view)."""
    from pipeline.distributed import wire

    link, plan = stage.link, stage.plan
    if plan.size == 1:
        return None
    hidden = np.zeros((1, 1, stage.hidden_size), np.uint32)
    logits = np.zeros((1, stage.vocab_size), np.uint32)
    header = wire.Header(wire.Command.FORWARD, 0, 1, False, True, 0, stage.hidden_size)

    def run() -> float:
        start = time.perf_counter()
        for _ in range(rounds):
            if not plan.first:
                link.doorbell.wait()
                wire.recv_header(plan.rank - 1)
                link.doorbell.wait()
                wire.recv(hidden.shape, np.uint32, plan.rank - 1)
            if plan.last:
                wire.send(logits, 0)
            else:
                wire.send_forward(header, [0], hidden, plan.rank + 1)
            if plan.first:
                link.doorbell.wait()
                wire.recv(logits.shape, np.uint32, plan.size - 1)
        return (time.perf_counter() - start) / rounds

    return link.call(run, timeout=300, what="ping")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--pool-mb", type=int, required=True, help="expert pool per rank")
    p.add_argument("--distributed", action="store_true")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--concurrent", action="store_true",
                   help="all prompts at once, in one decode batch: decode tok/s is then the "
                   "aggregate (decoded tokens over the wall time from the first token on)")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prefill-chunk", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ping-rounds", type=int, default=200)
    p.add_argument("--o-direct", action="store_true")
    p.add_argument("--strategy", default="next-gate", help="prefetch strategy (every rank)")
    p.add_argument("--run-ahead", default="auto", help="one process only: ranks always step "
                   "layer by layer")
    p.add_argument("--gpu-per-rank", action="store_true")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    configure_logging(args.log_level, False)
    cfg = _config(args)
    import mlx.core as mx

    result: dict[str, Any] = {"model": args.model, "pool_mb_per_rank": args.pool_mb,
                              "host": platform.node(), "device": str(mx.default_device()),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "argv": sys.argv[1:]}
    if not args.distributed:
        result |= {"ranks": 1, **trio.run(_generate, args, cfg)}
        result["hit_rate"] = result["hits"] / max(result["hits"] + result["misses"], 1)
        result["bytes_read_per_token"] = result["bytes_read"] / result["tokens"]
        return _write(args, result)

    from pipeline.distributed.job import STATS_FIELDS, _stage_loop, finish, join

    stage = join(cfg)
    ping = _ping(stage, args.ping_rounds)
    if stage.plan.first:
        gen = trio.run(_generate, args, cfg, stage)
        stage.shutdown()
    else:
        trio.run(_stage_loop, cfg, stage)
    table = finish(stage)
    if not stage.plan.first:
        return 0
    rows = [dict(zip(STATS_FIELDS, map(float, row), strict=True)) for row in table]
    hits, misses = sum(r["hits"] for r in rows), sum(r["misses"] for r in rows)
    decode_wait = rows[0]["decode_boundary_s"]
    decode_busy = sum(r["decode_busy_s"] for r in rows[1:])
    steps = max(rows[0]["decode_forwards"], 1)  # a batch step is one forward for its rows
    per_token = (decode_wait - decode_busy) / steps
    step = gen["decode_s"] / (steps if args.concurrent else max(gen["decode_tokens"], 1))
    result |= {
        "ranks": stage.plan.size, **gen,
        "hit_rate": hits / max(hits + misses, 1),
        "bytes_read_per_token": sum(r["bytes_read"] for r in rows) / gen["tokens"],
        "boundary_s_per_decode_token": per_token,
        "boundary_fraction_of_decode_step": per_token / step if step else None,
        "ping_round_trip_s": ping,
        "per_rank": rows,
    }
    return _write(args, result)


def _write(args: argparse.Namespace, result: dict[str, Any]) -> int:
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
