"""Sweeps around the default configuration, one dimension at a time (a full cross product
is hours on a small machine): pool size (smallest workable -> every expert) per prefetch
strategy, reader count, and prompt length. Every point is one `bench` case in its own
process; results go to one JSON file and plots next to it.

    python benchmarks/sweep.py CONTAINER -o benchmarks/results/cpu/sweep.json \
        --strategies next-gate,none --pool-points 4 --readers 1,8 --prompts 16,512
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402

from pipeline.bench.cases import Case, Result, run_case  # noqa: E402
from pipeline.bench.refs import container_summary  # noqa: E402
from pipeline.bench.report import plot_sweep, write_json  # noqa: E402
from pipeline.bench.summary import Report, machine_info  # noqa: E402


def pool_points(container: dict, chunk: int, n: int) -> list[int]:
    """Slot counts from the smallest workable pool to every expert, geometrically spaced."""
    smallest = min(container["num_experts"], chunk * container["top_k"])
    everything = container["num_experts"] * container["layers"]
    if n <= 1 or smallest >= everything:
        return [smallest]
    ratio = (everything / smallest) ** (1 / (n - 1))
    return sorted({min(everything, round(smallest * ratio**i)) for i in range(n)})


def plan(args: argparse.Namespace, container: dict) -> list[Case]:
    base_reader = {"concurrency": args.base_readers, "o_direct": args.o_direct}
    chunk = {"prefill_chunk": args.prefill_chunk}
    common = dict(model=str(args.model), max_tokens=args.max_tokens, cold=True, seed=args.seed)
    cases = []
    slots = pool_points(container, args.prefill_chunk, args.pool_points)
    for strategy in args.strategies:
        for n in slots:
            cases.append(Case(name=f"pool{n}-{strategy}", prompt_tokens=args.prompts[0], config={
                "pool": {"slots": n}, "reader": base_reader, "prefetch": {"strategy": strategy},
                "compute": chunk}, **common))
    mid = slots[len(slots) // 2]
    for r in args.readers:
        cases.append(Case(name=f"readers{r}", prompt_tokens=args.prompts[0], config={
            "pool": {"slots": mid}, "reader": {**base_reader, "concurrency": r},
            "prefetch": {"strategy": args.strategies[0]}, "compute": chunk}, **common))
    for p in args.prompts[1:]:
        cases.append(Case(name=f"prompt{p}", prompt_tokens=p, config={
            "pool": {"slots": mid}, "reader": base_reader,
            "prefetch": {"strategy": args.strategies[0]}, "compute": chunk}, **common))
    return cases


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("-o", "--out", type=Path, required=True, help="JSON report (plots beside it)")
    p.add_argument("--strategies", type=lambda s: s.split(","), default=["next-gate", "none"])
    p.add_argument("--pool-points", type=int, default=4)
    p.add_argument("--readers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--base-readers", type=int, default=4)
    p.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[16, 512])
    p.add_argument("--prefill-chunk", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--o-direct", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case-timeout", type=float, default=900)
    p.add_argument("--only", type=lambda s: s.split(","), default=None,
                   help="re-run only these points, replacing them in an existing --out")
    args = p.parse_args(argv)
    container = container_summary(args.model)
    report = Report(machine_info(), container, "benchmarks/sweep.py " + " ".join(argv))
    cases = plan(args, container)
    if args.only:
        cases = [c for c in cases if c.name in args.only]
        if args.out.exists():
            old = json.loads(args.out.read_text())
            report.command = old["command"] + " ; re-run: " + report.command
            report.results = [msgspec.convert(r, Result) for r in old["results"]
                              if r["name"] not in args.only]
    for case in cases:
        print(f"sweep: {case.name}", file=sys.stderr, flush=True)
        result = run_case(case, timeout_s=args.case_timeout)
        if result.error:
            print(f"sweep: {case.name} failed: {result.error}", file=sys.stderr)
        report.results.append(result)
        write_json(report.to_json(), args.out)  # after every point: a cut sweep keeps its data
    data = report.to_json()
    pool_results = [r for r in data["results"] if r["name"].startswith("pool")]
    plot_sweep(pool_results, args.out.with_suffix(".png"),
               f"{container['source']}: decode tok/s vs pool size ({data['machine'].get('device')})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
