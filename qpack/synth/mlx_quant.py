"""How mlx_lm.convert quantizes a checkpoint, for the synthetic MLX layouts: which rule each
module gets (the model's quant_predicate, a `--quant-predicate mixed_*` recipe, a
`--q-mode`) and the array conversions that make our bytes equal to its bytes.
"""

from __future__ import annotations

import numpy as np

from qpack.synth.init_weights import to_storage

# mlx_lm.convert --quant-predicate recipes: (low bits, high bits) as its mixed_quant_predicate.
MIXED_RECIPES = {"mixed_2_6": (2, 6), "mixed_3_4": (3, 4), "mixed_3_6": (3, 6), "mixed_4_6": (4, 6)}
# mlx_lm.convert --q-mode: default (group size, bits) per mode.
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


def module_rule(base: str, bits: int, gs: int, mode: str, recipe: str | None,
                num_layers: int, routers: tuple[str, ...] = ()) -> tuple[int, int, str, dict | None]:
    """(bits, group size, mode, the config override to record or None) of one module.
    `routers`: module suffixes the family's quant_predicate puts at 8 bits."""
    if recipe in MIXED_RECIPES:
        low, high = MIXED_RECIPES[recipe]
        index = next((int(p) for p in base.split(".") if p.isdigit()), 0)
        n = num_layers
        more = index < n // 8 or index >= 7 * n // 8 or (index - n // 8) % 3 == 2
        b = high if ("down_proj" in base and more) or "lm_head" in base else low
        # mlx_lm.convert hands the recipe its --q-group-size, None unless given, and records
        # that: `"group_size": null` (to_quantized then takes the mode's 64).
        recorded = None if gs == MODE_DEFAULTS["affine"][0] else gs
        return b, gs, "affine", {"group_size": recorded, "bits": b, "mode": "affine"}
    if routers and base.endswith(routers):
        # The model's quant_predicate; affine is to_quantized's default for its dict.
        return 8, 64, "affine", {"group_size": 64, "bits": 8}
    return bits, gs, mode, None


def mx_array(block: np.ndarray, dtype: str):  # -> mx.array
    import mlx.core as mx

    arr = mx.array(to_storage(block, dtype))
    return arr.view(mx.bfloat16) if dtype == "bfloat16" else arr


def np_storage(arr) -> np.ndarray:  # mx.array -> numpy bytes-compatible array
    import mlx.core as mx

    return np.array(arr.view(mx.uint16) if arr.dtype == mx.bfloat16 else arr)


def mlx_plus_one(block: np.ndarray, dtype: str) -> np.ndarray:
    # mlx-lm's sanitize adds 1.0 to zero-centred norms in the checkpoint's dtype: do the same
    # operation so the result is bit-identical to converting our HF output.
    return np_storage(mx_array(block, dtype) + 1.0)


def mlx_quantize(block: np.ndarray, dtype: str, bits: int, gs: int, mode: str = "affine"):
    import mlx.core as mx

    out = mx.quantize(mx_array(block, dtype), group_size=gs, bits=bits, mode=mode)
    q, s = out[0], out[1]
    b = out[2] if len(out) > 2 else None
    return np_storage(q), np_storage(s), (np_storage(b) if b is not None else None)
