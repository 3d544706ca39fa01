"""Where the event loop's time goes while a decode token waits for its reads (any backend).

    python benchmarks/host_profile.py [--tokens 48] [--device-wait emulate] [--slots 160]

A 40-layer model of the tiny qwen3_next shape (64 experts, top-8: a decode layer's reads
as the 35B's, at little compute cost), synthesized and packed under /tmp, its pool too small
for a token's experts so that every layer reads; the decode generation runs with cProfile
on the event loop's thread (the main thread: trio's), and the top functions by own time
are printed per MoE layer. `--device-wait emulate` runs the waited token's host side
(actors/awaited.py) as the GPU's wait would, with the wait itself on the MLX thread;
`off` profiles stepping.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import msgspec
import trio

from qpack.synth import presets

NAME = "profile40"


def container(root: Path) -> Path:
    """The 40-layer container (written once; reused while /tmp keeps it): float32 and
    packed unquantized, as the device-wait tests' model, since the emulated wait copies
    blobs as they are (a quantized pool on the CPU widens their scales)."""
    from qpack.synth.checkpoint import synthesize
    from qpack.writer import pack

    out = root / f"{NAME}.qpack"
    if (out / "manifest.json").exists():
        return out
    tiny = presets.PRESETS[("qwen3_next", "tiny")]
    presets.PRESETS[("qwen3_next", NAME)] = msgspec.structs.replace(
        tiny, name=NAME, num_hidden_layers=40, num_experts=64, num_experts_per_tok=8)
    source = root / f"{NAME}-hf"
    synthesize(source, "qwen3_next", NAME, dtype="float32", progress=False)
    pack(source, out, progress=False, bits=None)
    return out


async def run(model: Path, args: argparse.Namespace) -> pstats.Stats:
    from actors.sampling_params import SamplingParams
    from pipeline.config.loading import config_from_dict
    from pipeline.engine import open_engine

    cfg = config_from_dict({
        "model": {"path": str(model), "verify": "off"},
        "pool": {"slots": args.slots},
        "compute": {"device_wait": args.device_wait},
    }, source="<host_profile>")
    profile = cProfile.Profile()
    async with open_engine(cfg) as engine:
        params = SamplingParams(temperature=1.0, seed=1, max_tokens=8)
        async for _ in engine.generate(list(range(10, 26)), params):  # warm-up
            pass
        before = engine.counters()
        params = msgspec.structs.replace(params, seed=2, max_tokens=args.tokens)
        started = time.perf_counter()
        profile.enable()
        async for _ in engine.generate(list(range(30, 46)), params):
            pass
        profile.disable()
        spent = engine.counters() - before
        wall = time.perf_counter() - started
    layers = max(args.tokens * 40, 1)
    print(f"{args.tokens} tokens in {wall:.2f} s ({args.tokens / wall:.1f} tok/s), reads "
          f"{spent.reads}, waited tokens {spent.awaited_tokens}; per MoE layer: "
          f"{1e3 * wall / layers:.3f} ms, reads {spent.reads / layers:.2f}")
    return pstats.Stats(profile)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--slots", type=int, default=160, help="pool slots (40 layers x 8 = 320 a token)")
    p.add_argument("--device-wait", choices=("emulate", "off"), default="emulate")
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--sort", default="tottime")
    args = p.parse_args(argv)
    model = container(Path("/tmp/moestream-host-profile"))
    stats = trio.run(run, model, args)
    out = io.StringIO()
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats(args.sort).print_stats(args.top)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
