"""Quantized KV caches (`compute.kv_bits`): attention keys and values held at 4 or 8 bits.

A long context's state is mostly its attention layers' keys and values (the Gated
DeltaNet layers' state is fixed-size): at the 80B's dimensions 24 KiB a token at bf16,
768 MiB at 32k tokens, most of a small machine's budget after the dense core and the pool.
mlx-lm's `QuantizedKVCache` holds them as `mx.quantize` groups (data, scales, biases) and
its attention (`scaled_dot_product_attention` in mlx_lm.models.base) then runs the
quantized kernels; the engine uses both unchanged, so its logits with `kv_bits = N` are
mlx-lm's with the same cache (bit-identical on MLX's CPU backend, tests/test_kv_quant.py),
not those of the unquantized model: an opt-in trade, as llama.cpp's `--cache-type-k` and
mlx-lm's `--kv-bits`. The caches are quantized from the first token (llama.cpp's way; mlx-lm
converts its caches once they pass `--quantized-kv-start`).

Every plain KV layer of a family whose attention goes through mlx-lm's SDPA gets one
(`ForwardFamily.quantized_kv`); sliding-window rings, Gated DeltaNet states and the MTP
head's own cache stay as they are. A decode batch holds its rows' in one
`BatchQuantizedKVCache` (pipeline/models/batch_quant_cache.py: mlx-lm has none).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import version
from typing import Any, NamedTuple

import mlx.core as mx

from pipeline.config.errors import ConfigError

GROUP_SIZES = (32, 64, 128)  # what mx.quantize groups by (compute.kv_group_size)


class KVQuant(NamedTuple):
    bits: int
    group_size: int

    def element_bytes(self, itemsize: int) -> float:
        """Bytes a key or value element costs: its bits, and a scale and a bias (at the
        activations' width) per group."""
        return self.bits / 8 + 2 * itemsize / self.group_size


def kv_quant_for(bits: int, group_size: int, family: Any, parts: Any, name: str) -> KVQuant | None:
    """The setting for a model of family `name` (None: off); a family or head size it
    cannot serve is refused in one line."""
    if not bits:
        return None
    if not family.quantized_kv:
        raise ConfigError(f"compute.kv_bits = {bits}: {name}'s attention cannot "
                          "read a quantized KV cache (sinks or latent attention); use 0")
    _heads, _kv_heads, dim = _attention_shape(parts.args)
    if dim % group_size:
        fit = [str(g) for g in GROUP_SIZES if dim % g == 0]
        if not fit:
            raise ConfigError(f"compute.kv_bits = {bits}: this model's attention heads are "
                              f"{dim} wide, narrower than any quantization group "
                              f"({', '.join(map(str, GROUP_SIZES))}); use 0")
        raise ConfigError(f"compute.kv_group_size = {group_size} does not divide the "
                          f"attention's head size ({dim}); use {' or '.join(fit)}")
    return KVQuant(bits, group_size)


def _attention_shape(args: Any) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of a model's attention."""
    heads = int(args.num_attention_heads)
    kv_heads = int(getattr(args, "num_key_value_heads", None) or heads)
    return heads, kv_heads, int(getattr(args, "head_dim", None) or args.hidden_size // heads)


# The attention calls a generation makes, as the new tokens of each (cached before them:
# 0, 128, 129, 133): a prefill chunk whose keys fill whole 128-column tiles, a decode
# step and a 3-draft verify pass past them (odd lengths: a kernel's residue), a second
# chunk. MLX's CUDA backend picks a quantized_matmul kernel by shape and has none for
# some (mflux-community/mflux#563); on the H200, session 31, a 4096-token prompt with
# kv_bits = 4 failed after a minute.
PROBE_CALLS = (128, 1, 4, 61)


def probe_kernels(quant: KVQuant, parts: Any, dtype: mx.Dtype,
                  attend: Callable[..., mx.array] | None = None) -> None:
    """On the MLX thread, before the engine serves (a GPU backend): the model's attention
    over a quantized cache at its head geometry and `PROBE_CALLS`' shapes, so a backend
    without the kernels refuses the setting at start in one line, not a generation minutes
    in. `attend`: mlx-lm's `scaled_dot_product_attention` unless given."""
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.cache import QuantizedKVCache

    heads, kv_heads, dim = _attention_shape(parts.args)
    cache = QuantizedKVCache(group_size=quant.group_size, bits=quant.bits)
    call: Callable[..., mx.array] = attend or scaled_dot_product_attention
    try:
        key = mx.random.key(0)  # its own: the process's random state stays the sampler's
        for new in PROBE_CALLS:
            keys, values = (mx.random.normal((1, kv_heads, new, dim), key=key).astype(dtype) for _ in "kv")
            queries = mx.random.normal((1, heads, new, dim), key=key).astype(dtype)
            k, v = cache.update_and_fetch(keys, values)
            mx.eval(call(queries, k, v, cache=cache, scale=dim**-0.5,
                         mask="causal" if new > 1 else None))
    except (RuntimeError, ValueError) as e:
        text = " ".join(str(e).split())
        raise ConfigError(f"compute.kv_bits = {quant.bits}: MLX {version('mlx')} on "
                          f"{mx.default_device()} cannot attend over a quantized cache at this "
                          f"model's shapes ({text}); use 0") from e


def quantize_caches(caches: list[Any], quant: KVQuant) -> list[Any]:
    """A model's fresh caches with each plain KV cache a quantized one (in place)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    for i, c in enumerate(caches):
        if type(c) is KVCache:  # not a ring (RotatingKVCache), not a DeltaNet state
            caches[i] = QuantizedKVCache(group_size=quant.group_size, bits=quant.bits)
    return caches


def is_quantized(cache: Any) -> bool:
    return hasattr(cache, "bits") and hasattr(cache, "offset")


def kv_parts(cache: Any, filled: bool = False) -> list[mx.array]:
    """A KV cache's arrays: keys and values, or a quantized cache's (data, scales, biases)
    of each; `filled`: cut to the positions it holds."""
    if getattr(cache, "keys", None) is None:
        return []
    parts = [*cache.keys, *cache.values] if is_quantized(cache) else [cache.keys, cache.values]
    return [a[..., : cache.offset, :] for a in parts] if filled else parts


def set_kv_parts(cache: Any, arrays: list[mx.array]) -> None:
    """Put `kv_parts`' arrays back (the same kind of cache)."""
    half = len(arrays) // 2
    if is_quantized(cache):
        cache.keys, cache.values = tuple(arrays[:half]), tuple(arrays[half:])
    else:
        cache.keys, cache.values = arrays
