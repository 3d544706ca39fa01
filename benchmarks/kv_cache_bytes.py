"""What a long context's attention state costs with and without `compute.kv_bits`, measured
on mlx-lm's own caches at a model's attention dimensions (no forward pass: the keys and
values written are random; their bytes do not depend on their values).

    python benchmarks/kv_cache_bytes.py [--preset qwen3.6-35b-a3b] [--tokens 32768]
        [--dtype bfloat16] [--chunk 2048]

For each setting (unquantized, 8 and 4 bits, groups of 64) it fills one layer's cache
with `--tokens` positions, `--chunk` at a time as a prefill writes them, and prints the
bytes its arrays hold and MLX's active memory for it, times the model's full-attention
layers (the Gated DeltaNet layers' state is fixed-size and not counted here).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache  # noqa: E402

from qpack.synth.presets import get_preset  # noqa: E402


def fill(cache: KVCache | QuantizedKVCache, heads: int, dim: int, tokens: int, chunk: int,
         dtype: mx.Dtype) -> tuple[int, int]:
    """(bytes the cache's arrays hold, MLX's active memory growth) after `tokens` positions."""
    mx.clear_cache()
    before = mx.get_active_memory()
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        keys = mx.random.normal((1, heads, n, dim)).astype(dtype)
        values = mx.random.normal((1, heads, n, dim)).astype(dtype)
        cache.update_and_fetch(keys, values)
        mx.eval(cache.state[:2] if isinstance(cache, QuantizedKVCache) else cache.state)
    del keys, values
    mx.clear_cache()
    return cache.nbytes, mx.get_active_memory() - before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = ap.parse_args()
    dims = get_preset(None, args.preset)
    interval = getattr(dims, "full_attention_interval", 1) or 1
    layers = dims.num_hidden_layers // interval
    heads, dim = dims.num_key_value_heads, dims.head_dim
    dtype = getattr(mx, args.dtype)
    print(f"{args.preset}: {layers} full-attention layers, {heads} KV heads x {dim}, "
          f"{args.tokens} tokens, {args.dtype} activations, MLX {mx.__version__} {mx.default_device()}")
    base = None
    for bits in (0, 8, 4):
        cache = KVCache() if not bits else QuantizedKVCache(group_size=64, bits=bits)
        held, active = fill(cache, heads, dim, args.tokens, args.chunk, dtype)
        base = base or held
        print(f"  kv_bits {bits}: {held * layers / 2**20:8.1f} MiB for the model "
              f"({held / args.tokens / 1024:.2f} KiB a token a layer; MLX active "
              f"{active * layers / 2**20:.1f} MiB), {held / base:.3f}x")


if __name__ == "__main__":
    main()
