"""FP8 checkpoints with scaled e4m3 weights (the Qwen/DeepSeek "-FP8" repos, GLM's), read as bf16.

The Qwen and DeepSeek repos store most Linear weights as float8 e4m3 with one float32
`weight_scale_inv` per block of `weight_block_size` (128 x 128) and name the rest in
`modules_to_not_convert`. GLM-4.5 / 4.6's "-FP8" repos are llm-compressor's
(`compressed-tensors`, `float-quantized`): e4m3 weights with one `weight_scale` per output
row (`strategy: channel`; dynamic per-token activations, which a weight read ignores),
routers and the head in `ignore`. A row scale is a block of 1 row x the whole row, so
both read the same way. The packer reads them through this module one tensor (or one
expert row, or one chunk of rows) at a time: e4m3 -> float32 x the block's scale ->
bf16, then on exactly like a bf16 checkpoint (quantized once, the way mlx_lm.convert
would). Nothing is re-quantized from FP8 directly: the FP8 grid and MLX's affine grid
differ, so going through the dequantized values is the only faithful route.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

SCALE_SUFFIX = "_scale_inv"  # `x.weight` -> `x.weight_scale_inv`; fused `experts.gate_up_proj` likewise
FP8_TAG = "F8_E4M3"
WHOLE_ROW = 0  # a block's columns: every column of the row (compressed-tensors' channel scales)


@dataclass(frozen=True)
class Fp8Layout:
    """Where a source's e4m3 weights keep their scales."""

    block: tuple[int, int]  # rows x columns one scale covers (columns WHOLE_ROW: the row)
    suffix: str  # a weight's scale tensor is named weight name + suffix
    # Tensor name endings never read as tensors of their own: the scales (read with their
    # weights) and static activation scales (a weight read has no use for them).
    skipped: tuple[str, ...]

    def skips(self, name: str) -> bool:
        return name.endswith(self.skipped)


def block_layout(block: tuple[int, int]) -> Fp8Layout:
    """DeepSeek / Qwen "-FP8": `weight_scale_inv` per `weight_block_size` block."""
    return Fp8Layout(block, SCALE_SUFFIX, (SCALE_SUFFIX,))


# What llm-compressor writes beside its e4m3 weights that a weight read never uses as a
# tensor: the weight scales (read with their weights), static activation scales and
# quantized-KV-cache scales (`kv_cache_scheme`: mlx-lm keeps its cache in float).
_COMPRESSED_SKIPPED = (".weight_scale", ".input_scale", ".output_scale", ".k_scale", ".v_scale")


def channel_layout() -> Fp8Layout:
    """llm-compressor's `float-quantized` channel FP8: `weight_scale` [rows, 1]."""
    return compressed_layout((1, WHOLE_ROW))


def compressed_layout(block: tuple[int, int]) -> Fp8Layout:
    """llm-compressor's `float-quantized` FP8: `weight_scale` per row (`channel`) or per
    `block_structure` block (`block`, its FP8_BLOCK scheme)."""
    return Fp8Layout(block, "_scale", _COMPRESSED_SKIPPED)


def dequantize_rows(
    data: mx.array, scale: mx.array, block: tuple[int, int], first_row: int, dtype: mx.Dtype
) -> mx.array:
    """e4m3 bytes [rows, cols] (rows first_row.. of the tensor) x their blocks' scales.

    `scale` holds the block rows covering these rows ([ceil((first_row + rows) / b0) -
    first_row // b0, ceil(cols / b1)]); blocks at the edges are partial, as in the source.
    """
    rows, cols = data.shape[-2], data.shape[-1]
    b0, b1 = block
    if b1 == WHOLE_ROW:
        b1 = cols
        if scale.ndim < data.ndim:  # a row scale saved as [rows] rather than [rows, 1]
            scale = scale[..., None]
    s = mx.repeat(scale.astype(mx.float32), b0, axis=-2)
    offset = first_row - (first_row // b0) * b0
    s = s[..., offset : offset + rows, :]
    s = mx.repeat(s, b1, axis=-1)[..., :cols]
    out = (mx.from_fp8(data, dtype=mx.float32) * s).astype(dtype)
    mx.eval(out)
    return out


def scale_rows(first_row: int, rows: int, b0: int) -> tuple[int, int]:
    """Block rows of the scale tensor that cover tensor rows first_row..first_row+rows."""
    return first_row // b0, -(-(first_row + rows) // b0)
