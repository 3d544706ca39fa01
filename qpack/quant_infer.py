"""The quantization a saved weight was packed with, read from its shapes and dtypes.

The same rule as mlx-lm's `utils.infer_quant_config`, kept here because importing
`mlx_lm.utils` imports transformers (its tokenizer wrapper): ~220 MiB resident that an
engine would carry for its whole life only to answer this (measured on the 35B dims,
docs/memory.md).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

# Only affine keeps its scales in the weight dtype; every other mode allows one
# (bits, group_size) pair and stores uint8 scales.
_UINT8_SCALE_MODES = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}


def infer_quant_config(path: str, module: Any, weights: dict[str, mx.array]) -> dict[str, Any]:
    """group_size, bits and mode of `path`'s packed weight; `module` still unquantized."""
    scales = weights[f"{path}.scales"]
    in_dims = module.weight.shape[-1]
    group_size = in_dims // scales.shape[-1]
    bits = (weights[f"{path}.weight"].shape[-1] * 32) // in_dims
    if scales.dtype != mx.uint8:
        return {"group_size": group_size, "bits": bits, "mode": "affine"}
    mode = _UINT8_SCALE_MODES.get((bits, group_size))
    if mode is None:
        raise ValueError(f"cannot infer the quantization mode of {path}: "
                         f"{bits} bits with group size {group_size}")
    return {"group_size": group_size, "bits": bits, "mode": mode}
