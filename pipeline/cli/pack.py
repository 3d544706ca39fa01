"""`moestream pack`, `moestream verify`, `moestream info`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qpack import spec
from qpack.spec import QpackError

PACK_HELP = """\
Repack a checkpoint into a .qpack container: the dense core in dense.safetensors
(mlx-lm names, quantized as mlx-lm's convert would) and the routed experts in
experts/layer_NNN.bin, one aligned blob per expert.

SOURCE is a local checkpoint directory (HF safetensors, bf16/f16/f32, or an MLX
quantized checkpoint) or a hub repo id (owner/name; honours HF_ENDPOINT, HF_HUB_CACHE
and HF_TOKEN). Packing is resumable: re-run the same command after an interruption
(even kill -9 or a full disk) and it continues where it stopped; the result is
byte-identical to an uninterrupted pack.
"""


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.cli.commands import budget_arg
    p = sub.add_parser("pack", help="repack an HF/MLX checkpoint (local or hub) into a .qpack container",
                       description=PACK_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="checkpoint directory or hub repo id (owner/name)")
    p.add_argument("-o", "--output", required=True, type=Path, help="container directory to write (X.qpack)")
    p.add_argument("--bits", type=int, choices=(2, 3, 4, 5, 6, 8, 16), default=None,
                   help="quantize float experts and dense weights at this many bits; 16: keep float. "
                        "Default: the mode's (4 affine), unchanged for MLX-quantized sources")
    p.add_argument("--mode", choices=("affine", "mxfp4", "nvfp4", "mxfp8"), default="affine",
                   help="MLX quantization mode for float sources (default affine)")
    p.add_argument("--group-size", type=int, default=None,
                   help="quantization group size (default: the mode's: 64 affine, 32 mxfp4/mxfp8, 16 nvfp4)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="cast float weights first (default: the config's dtype when quantizing, "
                        "else the source dtype)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) for a repo id")
    p.add_argument("--verify-after", action="store_true", help="check every sha256 and crc32 after packing")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_pack)

    v = sub.add_parser("verify", help="check a container: structure, every file's sha256, every expert's crc32",
                       description="Check a .qpack container completely. Prints OK, or each problem found; "
                                   "exit status 1 when anything is wrong.")
    v.add_argument("container", type=Path, help="the .qpack directory")
    v.set_defaults(func=cmd_verify)

    i = sub.add_parser("info", help="show what a container holds and the smallest workable expert pool",
                       description="Summarize a .qpack container: model type, MoE layers, experts, top-k, "
                                   "stride, dense-core and expert bytes, quantization, smallest pool.")
    i.add_argument("container", type=Path, help="the .qpack directory")
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")
    i.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill step to size the smallest pool for "
                        "(default: compute.prefill_chunk's default)")
    i.add_argument("--memory-mb", type=budget_arg, default=None,
                   help="a total memory budget: the expert pool it gives and the hits to expect")
    i.add_argument("--no-advice", action="store_true",
                   help="skip the pool advice (a ~1 s replay of calibrated routing)")
    i.set_defaults(func=cmd_info)


def _error(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 2


def cmd_pack(args: argparse.Namespace) -> int:
    from qpack.reader import verify_container
    from qpack.writer import pack

    try:
        result = pack(args.source, args.output, bits=args.bits, group_size=args.group_size, dtype=args.dtype,
                      revision=args.revision, progress=not args.no_progress, mode=args.mode)
    except QpackError as exc:
        return _error(exc)
    print(f"packed {args.output}: {result.bytes_written / 1e6:.1f} MB in {result.seconds:.1f} s "
          f"({result.mb_s:.1f} MB/s)")
    if args.verify_after:
        report = verify_container(args.output)
        for problem in report.problems:
            print(problem, file=sys.stderr)
        if not report.ok:
            return 1
        print(f"verified: {report.files_checked} files, {report.experts_checked} experts OK")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from qpack.reader import verify_container
    from qpack.spec import QpackError

    if not Path(args.container).is_dir():  # nothing to check: one line, as `info` says it
        return _error(QpackError(args.container, "no such container"))
    report = verify_container(args.container, progress=_verify_progress())
    if report.ok:
        print(f"OK {args.container}: {report.files_checked} files, {report.experts_checked} experts")
        return 0
    # Problems are diagnostics: stderr, so `verify x > report` still shows them.
    for problem in report.problems:
        print(problem, file=sys.stderr)
    print(f"error: {len(report.problems)} problem(s) in {args.container}", file=sys.stderr)
    return 1


def _verify_progress():  # noqa: ANN202 - a rich progress callback, or None off a terminal
    if not sys.stderr.isatty():
        return None
    from pipeline.cli.progress import byte_progress

    return byte_progress("verify")


def info_dict(path: Path, prefill_chunk: int | None = None, advice: bool = False) -> dict:
    """What `info` shows, as plain data (with `advice`, the pool advice too)."""
    from pipeline.config.schema import ComputeConfig
    from qpack.reader import Container

    chunk = prefill_chunk or ComputeConfig().prefill_chunk
    with Container.open(path, verify="off") as c:
        m = c.manifest
        q = m.quantization
        # What the engine refuses below: a prefill chunk's layer may route to chunk x top_k
        # distinct experts, all pinned at once, each taking one slot of the tensors' bytes.
        slot_bytes = max((sum(t.nbytes for t in entry.format.tensors) for entry in m.layers), default=0)
        # chunk 0 (the default) follows the pool: any pool that holds one token's
        # experts works, prefill then runs in chunks of slots // top_k tokens.
        slots = min(m.num_experts, max(chunk, 1) * m.top_k)
        extra = ({"pool_advice": _advice(len(m.layers), m.num_experts, m.top_k, slot_bytes, m.model_type)}
                 if advice and m.layers and slot_bytes > 0 else {})
        return {**extra,
            "path": str(path),
            "model_type": m.model_type,
            "source": m.source,
            "num_layers": m.num_layers,
            "moe_layers": len(m.layers),
            "num_experts": m.num_experts,
            "top_k": m.top_k,
            "stride": m.max_stride,
            "expert_nbytes": max((entry.format.nbytes for entry in m.layers), default=0),
            "dense_bytes": m.dense_bytes,
            "expert_bytes": m.expert_bytes,
            "total_bytes": sum(f.size for f in m.files),
            # The MTP head's files: its dense part and, streamed, its experts' blobs.
            "mtp_bytes": sum(f.size for f in m.files if f.path in ("mtp.safetensors", spec.MTP_EXPERTS_FILE)),  # qpack.mtp.MTP_FILE: that module needs MLX, the CLI must not
            "mtp_streamed": m.mtp_experts is not None,
            "quantization": {"bits": q.bits, "group_size": q.group_size, "mode": q.mode,
                             "overrides": len(q.overrides)},
            "smallest_pool_bytes": c.smallest_pool_bytes,
            "prefill_chunk": chunk,
            "smallest_workable_slots": slots,
            "smallest_workable_pool_mb": -(-slots * slot_bytes // 2**20),
            "smallest_pool_note": "smallest_pool_bytes: decode alone (one layer's top-k experts); "
                                  "smallest_workable_pool_mb: what the engine accepts with prefill "
                                  "chunks of prefill_chunk tokens (0: following the pool), "
                                  "min(num_experts, max(chunk, 1)*top_k) experts",
        }


def _advice(moe_layers: int, num_experts: int, top_k: int, slot_bytes: int, model_type: str) -> dict:
    import msgspec

    from pipeline.config.schema import PoolConfig
    from pipeline.pool_advice import pool_advice
    from qpack.families import canonical, family

    published = canonical(model_type) is not None and family(model_type).published_routing
    return msgspec.to_builtins(pool_advice(moe_layers, num_experts, top_k, slot_bytes,
                                           eviction=PoolConfig().eviction,
                                           borrowed_for=None if published else model_type))


def _advice_rows(a: dict) -> list[tuple[str, str]]:
    rows = []
    for r in a["rows"]:
        gib = " (1 GiB)" if r["one_gib"] else ""
        rows.append((f"  --pool-mb {r['pool_mb']}{gib}",
                     f"{r['slots_per_layer']} experts per layer ({r['share']:.1%}): {r['hit_default']:.0%} "
                     f"hits with next-gate, {r['hit_no_prefetch']:.0%} without (random routing ~{r['share']:.0%})"))
    first = a["rows"][0]["pool_mb"] if a["rows"] else None
    want = ", ".join(f"{k}: " + ("more than the largest row" if v is None else
                                 f"--pool-mb {v} or less" if v == first else f"--pool-mb {v}")
                     for k, v in a["pool_mb_for_hits"].items())
    rows.append(("  pool for a hit rate", want))
    return rows


def _mb(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def cmd_info(args: argparse.Namespace) -> int:
    if args.prefill_chunk is not None:  # compute.prefill_chunk's range, checked before any work
        from actors.bounds import convert_bounded
        from pipeline.config.schema import ComputeConfig

        try:
            convert_bounded({"prefill_chunk": args.prefill_chunk}, ComputeConfig, "--prefill-chunk")
        except ValueError as exc:
            return _error(exc)
    try:
        info = info_dict(args.container, args.prefill_chunk, advice=not args.no_advice)
        if args.memory_mb not in (None, "off"):  # "off": no budget to plan
            import msgspec

            from pipeline.budget_info import budget_info

            info["memory_budget"] = msgspec.to_builtins(
                budget_info(args.container, args.memory_mb, info.get("pool_advice")))
    except (QpackError, ValueError) as exc:  # ValueError: PoolBudgetError, with its numbers
        return _error(exc)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    from pipeline.memory_facts import MemoryPlan

    q = info["quantization"]
    quant = "none (float)" if q["bits"] is None else (
        f"{q['bits']}-bit {q['mode']}, group {q['group_size']}" + (f", {q['overrides']} overrides" if q["overrides"] else ""))
    table = Table(title=str(args.container), show_header=False)
    rows = [
        ("model type", info["model_type"]),
        ("layers (MoE layers)", f"{info['num_layers']} ({info['moe_layers']})"),
        ("experts per layer", str(info["num_experts"])),
        ("top-k", str(info["top_k"])),
        ("expert stride", f"{info['stride']:,} B ({info['expert_nbytes']:,} B payload)"),
        ("dense core", _mb(info["dense_bytes"])),
        ("experts", _mb(info["expert_bytes"])),
        *([("MTP head", _mb(info["mtp_bytes"]) + (", experts streamed" if info["mtp_streamed"]
                                                  else ", experts resident"))]
          if info["mtp_bytes"] else []),
        ("total", _mb(info["total_bytes"])),
        ("quantization", quant),
        ("smallest pool", f"--pool-mb {info['smallest_workable_pool_mb']} ({info['smallest_workable_slots']} "
                          "experts) " + (f"with prefill chunks of {info['prefill_chunk']} tokens"
                                         if info["prefill_chunk"] else
                                         "(prefill chunks follow the pool: slots // top-k tokens, "
                                         "the whole prompt once a layer's experts fit)")),
        ("smallest pool (decode only)", f"{_mb(info['smallest_pool_bytes'])} = top-k x slot "
                                        "(largest stride; every variant when layers differ)"),
    ]
    if "pool_advice" in info:
        a = info["pool_advice"]
        borrowed = (f", borrowed: no published routing statistics for {a['borrowed_for']}"
                    if a.get("borrowed_for") else "")
        rows.append((f"pool advice ({a['eviction']})", "expected decode hits on trained-like routing "
                     f"(calibrated model, {a['family']} parameters{borrowed}; a replay, not a measurement)"))
        rows += _advice_rows(a)
    if "memory_budget" in info:
        b = info["memory_budget"]
        hit = "" if b["hit_expected"] is None else f"; expected decode hits {b['hit_expected']:.0%}"
        rows.append((f"--memory-mb {args.memory_mb}", MemoryPlan(**b["plan"]).line() + hit))
    for k, v in rows:
        table.add_row(k, v)
    Console(width=None if sys.stdout.isatty() else 160).print(table)  # no wrapping in pipes and logs
    return 0
