"""What kind of checkpoint a source is, decided from config.json and the file list alone.

Run before any weight is downloaded: a hub repo that cannot be packed (GPTQ, AWQ, GGUF,
...) is refused after two small requests, not after ~80 GB, and a repo's shards that hold
no text-model tensor (MTP heads, the vision tower) are never fetched. The same checks run
on local directories, so both give the same one-line message.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from qpack.families import canonical, family
from qpack.fp8 import Fp8Layout, block_layout, channel_layout, compressed_layout
from qpack.names import is_text_tensor
from qpack.spec import QpackError

SUPPORTED = ("bf16/f16/f32 safetensors (quantized at pack time), MLX-quantized safetensors "
             "(affine, mxfp4, nvfp4, mxfp8: copied as they are) and FP8 block- or "
             "channel-scaled safetensors (dequantized, then quantized like bf16)")
# HF `quantization_config.quant_method` values with no route to an MLX layout here.
_REFUSED = {
    "gptq": "GPTQ", "awq": "AWQ", "bitsandbytes": "bitsandbytes", "compressed-tensors":
    "compressed-tensors", "auto-round": "AutoRound", "hqq": "HQQ", "eetq": "EETQ",
    "aqlm": "AQLM", "quanto": "quanto", "exl2": "EXL2", "torchao": "torchao",
    "fbgemm_fp8": "FBGEMM FP8", "mxfp4": "OpenAI MXFP4 (transformers)", "gguf": "GGUF",
}


def hf_quantization(config: Mapping) -> dict | None:
    """The transformers `quantization_config` (one with a `quant_method`), or None.

    mlx-lm writes its own block under both `quantization` and `quantization_config`,
    without a quant_method: that one is MLX's, not an HF quantization."""
    for where in (config, config.get("text_config") or {}):
        block = where.get("quantization_config") if isinstance(where, Mapping) else None
        if isinstance(block, Mapping) and "quant_method" in block:
            return dict(block)
    return None


def is_fp8_block(block: Mapping | None) -> bool:
    """DeepSeek/Qwen-style FP8: e4m3 weights, one float32 `weight_scale_inv` per block."""
    return (block is not None and block.get("quant_method") == "fp8"
            and isinstance(block.get("weight_block_size"), list | tuple)
            and len(block["weight_block_size"]) == 2)


def _weights(block: Mapping) -> list[Mapping]:
    """Each compressed-tensors config group's `weights` arguments ({} where a group has none)."""
    groups = block.get("config_groups")
    if not isinstance(groups, Mapping):
        return []
    return [g["weights"] if isinstance(g, Mapping) and isinstance(g.get("weights"), Mapping) else {}
            for g in groups.values()]


def _compressed_fp8(block: Mapping) -> Fp8Layout | None:
    """llm-compressor's FP8 (GLM's "-FP8" repos): `float-quantized`, every group's weights
    8-bit floats scaled per output row (`channel`) or per 2-D block (`block`); None
    otherwise (`compressed_scheme` says what it is instead)."""
    weights = _weights(block)
    if block.get("format", "float-quantized") != "float-quantized" or not weights:
        return None
    layouts = set()
    for w in weights:
        if w.get("type") != "float" or w.get("num_bits") != 8:
            return None
        shape = w.get("block_structure")
        if w.get("strategy") == "channel":
            layouts.add(channel_layout())
        elif w.get("strategy") == "block" and isinstance(shape, list | tuple) and len(shape) == 2:
            layouts.add(compressed_layout((int(shape[0]), int(shape[1]))))
        else:
            return None
    # Groups with different scale layouts (one per module class) are one layout too few here.
    return layouts.pop() if len(layouts) == 1 else None


def compressed_scheme(block: Mapping) -> str:
    """A compressed-tensors quantization in words, for the line that refuses it: the
    format and each group's weight type, bits and scale strategy."""
    kinds = sorted({f"{w.get('type', '?')} {w.get('num_bits', '?')}-bit weights scaled per "
                    f"{w.get('strategy', '?')}" for w in _weights(block)}) or ["no weight groups"]
    return f"format {block.get('format', '?')!r}, " + "; ".join(kinds)


def fp8_layout(config: Mapping) -> Fp8Layout | None:
    """Where the source's e4m3 weights keep their scales (qpack.fp8); None: not FP8."""
    block = hf_quantization(config)
    if block is None:
        return None
    if is_fp8_block(block):
        return block_layout((int(block["weight_block_size"][0]), int(block["weight_block_size"][1])))
    if block.get("quant_method") == "compressed-tensors":
        return _compressed_fp8(block)
    return None


def check_files(files: Iterable[str], where: str | Path) -> None:
    """Refuse a file list with nothing packable in it (GGUF-only repos, .bin-only repos)."""
    names = [f.rsplit("/", 1)[-1] for f in files]
    if any(n.endswith(".safetensors") for n in names):
        return
    if any(n.endswith(".gguf") for n in names):
        raise QpackError(where, f"holds GGUF files, which moestream does not pack; it packs {SUPPORTED}")
    if any(n.endswith((".bin", ".pt", ".pth")) for n in names):
        raise QpackError(where, f"holds PyTorch pickles (.bin) only, which moestream does not "
                         f"read (they can run code); it packs {SUPPORTED}")


def check_config(config: Mapping, where: str | Path) -> None:
    """Refuse a quantization this packer cannot read, naming it and what is supported."""
    block = hf_quantization(config)
    if block is None or fp8_layout(config) is not None:
        return
    method = str(block.get("quant_method"))
    own = canonical(config.get("model_type"))
    if own is not None and method in family(own).native_quant_methods:
        return  # read as the family's own layout (gpt-oss's mxfp4 experts, kept as they are)
    name = _REFUSED.get(method.lower(), method)
    if method == "fp8":
        raise QpackError(where, "FP8 checkpoint with per-tensor scales (no 2-D weight_block_size) "
                         f"is not supported; moestream packs {SUPPORTED}")
    if method == "compressed-tensors":
        raise QpackError(where, f"compressed-tensors checkpoint ({compressed_scheme(block)}) is not "
                         f"supported; moestream packs {SUPPORTED} (compressed-tensors: format "
                         "'float-quantized', 8-bit float weights scaled per channel or per block). "
                         "Use the model's bf16 repo")
    raise QpackError(where, f"{name} checkpoints (quantization_config.quant_method {method!r}) "
                     f"are not supported; moestream packs {SUPPORTED}. Use the model's bf16 repo")


def needed_shards(weight_map: Mapping[str, str], config: Mapping) -> set[str]:
    """Shards holding at least one text-model or MTP tensor (the packer keeps the MTP head,
    qpack/mtp.py); vision-only ones are skipped. An unsupported model_type keeps every
    shard (open_source refuses it with one line)."""
    name = canonical(config.get("model_type"))
    if name is None:
        return set(weight_map.values())
    text = family(name).text_config(dict(config))
    return {shard for tensor, shard in weight_map.items()
            if is_text_tensor(name, tensor, text) or tensor.startswith("mtp.")}
