"""`moestream bench` and `moestream bench-container`."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

import msgspec

from actors.prefetch.registry import DEPTH_STRATEGIES, strategies_help
from pipeline.bench.cases import Case, run_case
from pipeline.bench.rounds import round_name
from pipeline.bench.routing import ROUTINGS
from pipeline.bench.speculative import (
    is_spec_case,
    reference_name,
    spec_case_fields,
    speculation_table,
    with_references,
)
from pipeline.bench.summary import Report, machine_info
from pipeline.cli.commands import count_or, readers_arg
from pipeline.cli.counts import LAYERS, ROUNDS, TOKENS, WORKERS, seconds
from qpack import families
from qpack.synth.presets import FULL_SIZE

# The default run; warm-all (every expert pooled, vs mlx-lm resident in the same
# process) and the long-prompt pair are asked for by name.
CASES = ("default", "serial", "resident", "io")
# batch-N / batch-warm-N: N sequences in one decode batch (cold pool / every expert pooled).
BATCHES = tuple(f"batch{w}-{n}" for w in ("", "-warm") for n in (1, 2, 4, 8))
ALL_CASES = (*CASES, "warm-all", "long-prompt", "long-prompt-c256", *BATCHES)
# Speculative decoding (pipeline/bench/speculative.py): spec-k{1-8}-a{acceptance},
# spec-auto-a{acceptance}, spec-auto, spec-ngram, spec-mtp, and warm-spec-... of each.
DEFAULT_POOL_MB = 1024


def plan_cases(args: argparse.Namespace) -> list[Case]:
    """default = as configured; serial = overlap off; resident = mlx-lm; io = disk bandwidth."""
    pool: dict[str, Any] = {"slots": args.slots} if args.slots else {"budget_mb": args.pool_mb or DEFAULT_POOL_MB}
    if args.eviction:
        pool["eviction"] = args.eviction
    if args.bank_slots:
        pool["bank_slots"] = args.bank_slots
    base: dict[str, Any] = {
        "pool": pool,
        "reader": {"concurrency": args.readers, "o_direct": args.o_direct, "demand_lane": args.demand_lane,
                   "prefetch_yields": args.prefetch_yields == "on", "device_copy": args.device_copy,
                   "land": args.land, "switch_interval_ms": args.switch_interval_ms, "io": args.io,
                   "gil_hand_over": args.gil_hand_over == "on"},
        "prefetch": {"strategy": args.strategy, "depth": args.depth, "extra": args.prefetch_extra,
                     "max_per_layer": args.max_per_layer,
                     "pass_max_per_layer": args.pass_max_per_layer},
        "compute": {"prefill_chunk": args.prefill_chunk, "device_wait": args.device_wait,
                    "kv_bits": args.kv_bits, "decode_ahead": args.decode_ahead},
    }
    common = dict(model=str(args.model), prompt_tokens=args.prompt_tokens,
                  max_tokens=args.max_tokens, cold=not args.warm, seed=args.seed)
    cases: list[Case] = []
    for i, routing in enumerate(args.routing):
        # The first routing's cases keep their names (the derived ratios use them).
        suffix = "" if i == 0 else f"@{routing}"
        for case in _cases(args, base, {**common, "routing": routing}):
            cases.append(msgspec.structs.replace(case, name=case.name + suffix))
    # One timeline, of the case asked for (its first routing's run).
    return [msgspec.structs.replace(c, trace=args.trace) if args.trace and c.name == args.trace_case else c
            for c in cases]


def _cases(args: argparse.Namespace, base: dict[str, Any], common: dict[str, Any]) -> list[Case]:
    cases: list[Case] = []
    for name in args.cases:
        if name == "default":
            cases.append(Case(name="default", config=base, **common))
        elif name == "serial":
            serial = {**base, "compute": {**base["compute"], "overlap": False}}
            cases.append(Case(name="serial", config=serial, **common))
        elif name == "resident":
            cases.append(Case(name="resident", kind="resident", **common))
        elif name == "io":
            cases.append(Case(name="io", kind="io", config=base, **common))
        elif name == "warm-all":
            cases.append(Case(name="warm-all", config=base, warm_all=True,
                              **{**common, "cold": False}))
        elif name == "long-prompt":
            # One pass of the disk per prompt (the chunk follows the pool) ...
            cases.append(Case(name="long-prompt", config=base,
                              **{**common, "prompt_tokens": args.long_prompt, "max_tokens": 8}))
        elif name == "long-prompt-c256":
            # ... against fixed 256-token chunks (the earlier default).
            fixed = {**base, "compute": {**base["compute"], "prefill_chunk": 256}}
            cases.append(Case(name="long-prompt-c256", config=fixed,
                              **{**common, "prompt_tokens": args.long_prompt, "max_tokens": 8}))
        elif is_spec_case(name):
            fields = spec_case_fields(name, base)
            warm = fields["warm_all"]
            cases.append(Case(name=name, **fields, **{**common, "cold": common["cold"] and not warm}))
        elif name in BATCHES:
            warm = name.startswith("batch-warm")
            cases.append(Case(name=name, config=base, warm_all=warm,
                              concurrency=int(name.rsplit("-", 1)[1]),
                              **{**common, "cold": common["cold"] and not warm}))
    return cases


def first_bad_config(cases: list[Case]) -> str | None:
    """What is wrong with the first case whose engine config does not validate (a flag out
    of its key's range, e.g. --bank-slots -1), or None: refused before any case runs, not
    found by each case's own process."""
    from pipeline.bench.spec import engine_dict
    from pipeline.config.loading import ConfigError, config_from_dict

    for case in cases:
        try:
            config_from_dict(engine_dict(case), source=f"<bench {case.name}>")
        except ConfigError as exc:
            return str(exc)
    return None


def run_bench(args: argparse.Namespace, cases: list[Case], command: str) -> dict[str, Any]:
    from rich.console import Console

    from pipeline.bench.refs import container_summary
    from pipeline.bench.report import write_json

    err = Console(stderr=True)
    report = Report(machine_info(), container_summary(args.model), command)
    planned = with_references(cases)
    for n in range(1, args.rounds + 1):  # one round after the other (pipeline/bench/rounds.py)
        for case in planned:
            case = msgspec.structs.replace(case, name=round_name(case.name, n),
                                           trace=case.trace if n == 1 else None)
            if case.reference:
                ref = report.by_name(reference_name(case.name))
                case.draft_reference = list(ref.token_ids) if ref is not None else []
            err.print(f"[dim]bench: {case.name} ...[/dim]")
            result = run_case(case, timeout_s=args.case_timeout)
            if result.error:
                err.print(f"[red]bench: {case.name} failed:[/red] {result.error}")
            report.results.append(result)
            if args.json:  # after every case: a bench stopped by a time limit keeps what it ran
                write_json(report.to_json(), args.json)
    return report.to_json()


def _cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pipeline.bench.report import plot_timeline, read_path_table, results_table, write_json

    unknown = [c for c in args.cases if c not in ALL_CASES and not is_spec_case(c)]
    if unknown:
        print(f"error: unknown case(s) {unknown}; choose from {list(ALL_CASES)}, or a speculative "
              "case: spec-k{1-8}-a{A}, spec-auto-a{A}, spec-auto, spec-ngram, spec-mtp, warm-spec-... "
              "(e.g. spec-k2-a0.8)", file=sys.stderr)
        return 2
    bad = [r for r in args.routing if r not in ROUTINGS]
    if bad or not args.routing:
        print(f"error: unknown routing {bad or args.routing}; choose from {list(ROUTINGS)}", file=sys.stderr)
        return 2
    if args.trace and args.trace_case not in args.cases:
        print(f"error: --trace-case {args.trace_case!r} is not among --cases {','.join(args.cases)}",
              file=sys.stderr)
        return 2
    if args.pool_mb is not None and args.slots is not None:
        print("error: --pool-mb and --slots are exclusive: give one", file=sys.stderr)
        return 2
    if not (Path(args.model) / "manifest.json").is_file():
        print(f"error: {args.model}: not a .qpack container (no manifest.json)", file=sys.stderr)
        return 2
    if args.json:  # checked before the cases run, not after
        from qpack.output_guard import check_output_file
        from qpack.spec import QpackError

        try:
            check_output_file(args.json, "--json")
        except QpackError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    cases = plan_cases(args)
    if (wrong := first_bad_config(cases)) is not None:
        print(f"error: {wrong}", file=sys.stderr)
        return 2
    report = run_bench(args, cases, "moestream bench " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else []))
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 220)
    console.print(results_table(report))
    if (reads := read_path_table(report)) is not None:
        console.print(reads)
    from pipeline.memory_breakdown import memory_table

    if (memory := memory_table(report)) is not None:
        console.print(memory)
    if (spec := speculation_table(report)) is not None:
        console.print(spec)
    from pipeline.bench.agreement import disagreement

    if (differ := disagreement(report)) is not None:
        print(differ, file=sys.stderr)
    if args.json:
        write_json(report, args.json)
    if args.trace and args.plots:
        Path(args.plots).mkdir(parents=True, exist_ok=True)
        if plot_timeline(args.trace, Path(args.plots) / "timeline.png") is None:
            print("bench: timeline plot skipped (matplotlib missing or no decode step)", file=sys.stderr)
    failed = [r for r in report["results"] if r.get("error")]
    if failed:
        print(f"error: {len(failed)} of {len(report['results'])} bench cases failed: "
              + "; ".join(f"{r.get('name')}: {' '.join(str(r['error']).split())[:300]}" for r in failed),
              file=sys.stderr)
    return 1 if failed else 0


def _cmd_bench_container(args: argparse.Namespace) -> int:
    from qpack.spec import QpackError
    from qpack.synth.bench_container import write_bench_container
    from qpack.synth.presets import get_preset

    try:
        dims = get_preset(args.family, args.preset)
        result = write_bench_container(args.out, dims.family, args.preset, bits=args.bits,
                                       group_size=args.group_size, seed=args.seed,
                                       max_layers=args.max_layers, workers=args.workers,
                                       mtp=args.mtp)
    except (ValueError, QpackError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{result.path}: {result.bytes_written / 1e9:.2f} GB in {result.seconds:.1f} s "
          f"({result.mb_s:.0f} MB/s; experts {result.experts_mb_s:.0f} MB/s, dense {result.dense_seconds:.1f} s)")
    return 0


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pool-mb", type=int, default=None,
                   help=f"expert pool budget in MiB (default {DEFAULT_POOL_MB})")
    p.add_argument("--slots", type=int, default=None, help="expert pool size in experts (instead of --pool-mb)")
    p.add_argument("--eviction", default=None, help="pool eviction policy (default: the config's, reuse)")
    p.add_argument("--bank-slots", type=int, default=0,
                   help="at most this many slots per pool bank (pool.bank_slots; default 0: the most "
                        "the expert kernels index right)")
    p.add_argument("--readers", type=readers_arg, default="auto",
                   help="expert reads in flight: a number or auto (the queue depth measured at start; default)")
    p.add_argument("--demand-lane", type=int, default=1,
                   help="disk threads beside --readers that take demand reads only (default 1)")
    p.add_argument("--device-copy", choices=("auto", "direct", "load", "prefetch"), default="auto",
                   help="how blobs reach GPU memory: DMA from pinned staging buffers (direct), MLX's "
                        "Load (pageable copy), managed memory prefetched by the driver; auto: direct "
                        "where its probe passes, else load (default auto)")
    p.add_argument("--prefetch-yields", choices=("on", "off"), default="on",
                   help="no prediction starts while a demand read runs (default on)")
    p.add_argument("--land", choices=("auto", "on", "off"), default="auto",
                   help="install reads where they land, on a staging thread, between layers "
                        "(off: at the next demand, on the MLX thread; auto, the default: on)")
    p.add_argument("--switch-interval-ms", type=float, default=0.2,
                   help="the GIL's switch interval while readers run (reader.switch_interval_ms; "
                        "default 0.2)")
    p.add_argument("--io", choices=("threads", "uring"), default="threads",
                   help="how reads reach the disk: disk threads, or one io_uring "
                        "(reader.io; default threads)")
    p.add_argument("--gil-hand-over", choices=("on", "off"), default="off",
                   help="the event loop gives the GIL to the disk threads after submitting a "
                        "layer's reads (reader.gil_hand_over; default off)")
    p.add_argument("--device-wait", choices=("auto", "off", "emulate"), default="auto",
                   help="decode tokens that read experts queued whole, the GPU waiting for the "
                        "reads (auto, the default: on MLX's CUDA backend where its probe passes "
                        "and the disk reads >= 4 GB/s; off: one host sync per MoE layer)")
    p.add_argument("--decode-ahead", choices=("auto", "on", "off"), default="auto",
                   help="with every expert pooled, a lone sequence queues a second decode step "
                        "(compute.decode_ahead; auto, the default: on GPUs; on; off: one step queued)")
    p.add_argument("--kv-bits", type=int, choices=(0, 4, 8), default=0,
                   help="attention keys and values at 4 or 8 bits (compute.kv_bits; default 0): "
                        "the long-prompt case's state and memory with a quantized KV cache")
    p.add_argument("--strategy", default="next-gate",
                   help=f"prefetch strategy of the default case ({strategies_help()})")
    p.add_argument("--prefetch-extra", type=int, default=0,
                   help="experts a gate strategy predicts beyond top-k per layer (default 0)")
    p.add_argument("--max-per-layer", type=int, default=None,
                   help="cap on the experts predicted for a layer (prefetch.max_per_layer; "
                        "default none): a verify pass's or prompt chunk's union cut to its best")
    p.add_argument("--pass-max-per-layer", type=count_or("auto", "off"), default="auto",
                   help="a verify pass's predicted experts a layer (prefetch.pass_max_per_layer: "
                        "a number, auto = 1.5 x the top-k, or off)")
    p.add_argument("--depth", type=int, default=1,
                   help=f"layers ahead the strategy predicts ({', '.join(DEPTH_STRATEGIES)}; "
                   "default 1)")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="prompt tokens per prefill step (default 0: follow the pool)")
    p.add_argument("--long-prompt", type=TOKENS, default=1024,
                   help="prompt length of the long-prompt cases (default 1024)")
    p.add_argument("--prompt-tokens", type=TOKENS, default=16, help="prompt length (default 16)")
    p.add_argument("--max-tokens", type=TOKENS, default=32, help="tokens to generate (default 32)")
    p.add_argument("--o-direct", action="store_true", help="read experts with O_DIRECT")
    p.add_argument("--warm", action="store_true", help="keep the page cache (default: cold runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing", type=lambda s: s.split(","), default=["router"],
                   help="who picks the experts, comma-separated, each case runs once per "
                   "value: router (the container's own; default), calibrated (the routing "
                   "model fitted to trained routers, benchmark only; next-gate still applies "
                   "the container's routers), calibrated-gate (and gate strategies see the "
                   "model's emulated gate-ahead); in batch-N cases each row routes as its own "
                   "request; cases of the 2nd value and later are named 'case@routing'")
    p.add_argument("--rounds", type=ROUNDS, default=1,
                   help="run the cases this many times, one round after the other (default 1): "
                        "a speculating case's x plain is the median of its rounds' ratios, each "
                        "over its own round's plain run; later rounds' results are named case#N")
    p.add_argument("--case-timeout", type=seconds(86400), default=None, help="seconds per case before giving up")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="measure tok/s, memory and I/O against the serial/resident/disk ceilings",
        description="Run each case in its own process on a cold page cache: 'default' (as "
        "configured), 'serial' (no prefetch, no overlap: the plain streamer), 'resident' "
        "(mlx-lm with every expert in memory: the compute ceiling) and 'io' (random expert "
        "reads: the disk's bandwidth; x bytes per decode token = the I/O ceiling). Prints a "
        "table, writes JSON, and with --trace and --plots a timeline of one decode step.")
    p.add_argument("model", type=Path, help="path of a .qpack container")
    p.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES),
                   help=f"comma-separated cases (default {','.join(CASES)}; "
                   f"all: {','.join(ALL_CASES)}; speculative decoding: spec-k{{1-8}}-a{{A}} "
                   "(emulated acceptance A, drafts from the plain run's tokens), spec-auto-a{A}, "
                   "spec-auto, spec-ngram, spec-mtp, and warm-spec-... of each: "
                   "docs/speculative.md)")
    add_bench_flags(p)
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--trace", help="write a case's Chrome/Perfetto timeline here (--trace-case)")
    p.add_argument("--trace-case", default="default", metavar="CASE",
                   help="the case --trace records (default: default; e.g. long-prompt, spec-auto)")
    p.add_argument("--plots", help="directory for PNG plots (needs matplotlib)")
    p.set_defaults(func=_cmd_bench)

    c = sub.add_parser(
        "bench-container", help="write a benchmark container fast (real dims, random experts)",
        description="Write a valid .qpack directly, without synth + pack: the dense core as "
        "synth --bits writes it, experts as random 4-bit words with scales that give "
        "zero-mean weights of std ~1/sqrt(fan_in). For speed measurements only.")
    c.add_argument("--family", choices=families.names(), default=None)
    c.add_argument("--preset", required=True, help="a synth preset; the real-dimension ones imply "
                   f"their family: {', '.join(sorted(FULL_SIZE))}")
    c.add_argument("-o", "--out", required=True, type=Path, help="output .qpack directory")
    c.add_argument("--bits", type=int, choices=(4, 8), default=4)
    c.add_argument("--group-size", type=int, default=64)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--max-layers", type=LAYERS, default=None, help="only the first N layers")
    c.add_argument("--mtp", action="store_true",
                   help="with the MTP head (8-bit, random weights: for the spec-mtp case's cost)")
    c.add_argument("--workers", type=WORKERS, default=None, help="writer threads (default: cores, <= 16)")
    c.set_defaults(func=_cmd_bench_container)
