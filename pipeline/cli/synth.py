"""`moestream synth`: write a synthetic checkpoint (random weights, real layout and tokenizer)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.cli.counts import LAYERS, count
from qpack.synth.presets import FAMILIES, FULL_SIZE, get_preset, preset_names
from qpack.synth.tokenizer_files import FORMATS as TOKENIZER_FORMATS
from qpack.synth.variants import VARIANTS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "synth",
        help="write a synthetic HF-format or MLX-quantized checkpoint (random weights)",
        description=(
            "Write a checkpoint with the hub's config.json field names, tensor names and "
            "sharding, the real Qwen tokenizer files, and random weights (deterministic per "
            "seed). Text generated from it is meaningless: the weights are random. Presets: "
            "tiny (unit tests), demo (~1 GB), and the true dimensions of "
            + ", ".join(f"{name} ({fam})" for name, fam in FULL_SIZE.items())
            + ", which imply their family."
        ),
    )
    p.add_argument("--family", choices=FAMILIES, default=None,
                   help="model family (implied by the full-size preset names)")
    p.add_argument("--preset", required=True, choices=preset_names(), help="model dimensions")
    p.add_argument("-o", "--out", required=True, type=Path, help="output directory")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="weight dtype, also of scales/biases when quantized (default bfloat16)")
    p.add_argument("--bits", type=int, choices=(4, 8), default=None,
                   help="write mlx-lm's quantized layout at this many bits (routers at 8)")
    p.add_argument("--group-size", type=int, default=64, help="quantization group size (default 64; "
                   "the mode's own with --mode)")
    p.add_argument("--mode", choices=("affine", "mxfp4", "nvfp4", "mxfp8"), default="affine",
                   help="with --bits (or alone): mlx_lm.convert --q-mode (default affine)")
    p.add_argument("--recipe", choices=("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6", "float_experts"),
                   default=None, help="mlx_lm.convert --quant-predicate recipe (MLX layout), or "
                   "float_experts: everything quantized but the routed experts")
    p.add_argument("--layout", choices=("hub", "per-expert"), default="hub",
                   help="hub: as the hub ships it (default); per-expert: a family's second HF "
                   "layout where it has one (Qwen3.5 MoE: transformers' text-only class)")
    p.add_argument("--variant", choices=sorted({v for vs in VARIANTS.values() for v in vs}),
                   default=None, help="chat variant (template and generation_config; the first "
                   "is the family's default): " + "; ".join(f"{fam} {', '.join(vs)}"
                                                            for fam, vs in VARIANTS.items()))
    p.add_argument("--tokenizer-format", choices=list(TOKENIZER_FORMATS), default="json",
                   help="json: tokenizer.json (default); tiktoken: tiktoken.model and no "
                   "tokenizer.json, as Kimi-K2's release ships it (pack converts it)")
    p.add_argument("--seed", type=int, default=0, help="random seed: same seed, same bytes (default 0)")
    p.add_argument("--shard-mb", type=count(1, 1 << 20), default=None,
                   help="maximum shard size in MiB (default: 8 for tiny, 2048 otherwise)")
    p.add_argument("--max-layers", type=LAYERS, default=None,
                   help="write only the first N decoder layers (config included): for "
                   "measuring the full-size presets without writing them whole")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from qpack.output_guard import removed_on_failure
    from qpack.spec import QpackError
    from qpack.synth.checkpoint import synthesize

    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        # Synthesis replaces shards and configs: never over something already there.
        print(f"error: {args.out}: exists and is not empty; remove it or choose another -o",
              file=sys.stderr)
        return 2
    try:
        dims = get_preset(args.family, args.preset)
        with removed_on_failure(args.out):  # a failed synth leaves nothing to refuse next time
            synthesize(
                args.out,
                dims.family,
                args.preset,
                dtype=args.dtype,
                bits=args.bits,
                group_size=args.group_size,
                seed=args.seed,
                layout=args.layout,
                variant=args.variant,
                mode=args.mode,
                recipe=args.recipe,
                tokenizer_format=args.tokenizer_format,
                shard_bytes=args.shard_mb * 1024 * 1024 if args.shard_mb else None,
                max_layers=args.max_layers,
                progress=not args.no_progress and sys.stderr.isatty(),
            )
    except (ValueError, QpackError) as exc:  # bad arguments, or no room: refused before writing
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(args.out)
    return 0
