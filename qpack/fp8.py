"""FP8 block-scaled checkpoints (Qwen/DeepSeek "-FP8" repos), read as bf16.

Those repos store most Linear weights as float8 e4m3 with one float32 `weight_scale_inv`
per block of `weight_block_size` (128 x 128) and name the rest in
`modules_to_not_convert`. The packer reads them through this module one tensor (or one
expert row, or one chunk of rows) at a time: e4m3 -> float32 x the block's scale ->
bf16, then on exactly like a bf16 checkpoint (quantized once, the way mlx_lm.convert
would). Nothing is re-quantized from FP8 directly: the FP8 grid and MLX's affine grid
differ, so going through the dequantized values is the only faithful route.
"""

from __future__ import annotations

import mlx.core as mx

SCALE_SUFFIX = "_scale_inv"  # `x.weight` -> `x.weight_scale_inv`; fused `experts.gate_up_proj` likewise
FP8_TAG = "F8_E4M3"


def dequantize_rows(
    data: mx.array, scale: mx.array, block: tuple[int, int], first_row: int, dtype: mx.Dtype
) -> mx.array:
    """e4m3 bytes [rows, cols] (rows first_row.. of the tensor) x their blocks' scales.

    `scale` holds the block rows covering these rows ([ceil((first_row + rows) / b0) -
    first_row // b0, ceil(cols / b1)]); blocks at the edges are partial, as in the source.
    """
    rows, cols = data.shape[-2], data.shape[-1]
    b0, b1 = block
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
