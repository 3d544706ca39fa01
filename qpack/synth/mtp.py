"""The MTP head of a synthetic checkpoint, in the hub's layout (random weights).

Qwen3-Next and Qwen3.5/3.6 ship one multi-token-prediction module at the checkpoint's
root, outside the text model: `mtp.fc` [H, 2H] over concat(norm(embedding),
norm(hidden)), `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, one full
decoder layer `mtp.layers.0.*` (gated attention and its own sparse MoE with a shared
expert) and `mtp.norm`; the embedding and lm_head are the model's. Routed experts are
per expert on Qwen3-Next (`mtp.layers.0.mlp.experts.{e}.{proj}.weight`) and fused on
Qwen3.5/3.6 (`mtp.layers.0.mlp.experts.gate_up_proj` [E, 2I, H], `.down_proj` [E, H, I]),
as their main layers are. Norms are zero-centred, as everywhere in these checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from functools import partial

import numpy as np

from qpack.families import family
from qpack.synth.init_weights import NORM_STD, Init, WeightSource
from qpack.synth.presets import ModelDims
from qpack.synth.st_write import ST_DTYPES, TensorEntry
from qpack.synth.tensor_inits import dense_inits, expert_init


def mtp_inits(dims: ModelDims) -> list[tuple[str, Init]]:
    """The head's tensors but its routed experts: (hub name, init)."""
    h = dims.hidden_size
    out = [("mtp.fc.weight", Init("mtp.fc.weight", (h, 2 * h), "normal", 1.0 / math.sqrt(2 * h)))]
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        key = f"mtp.{name}.weight"
        out.append((key, Init(key, (h,), "normal", NORM_STD)))
    fa = dims.full_attention_interval - 1  # a full-attention layer: the MTP layer's kind
    assert not dims.is_linear(fa)
    mtp_layer = dims.num_hidden_layers  # its own values (and router) after the last layer
    for rel, init in dense_inits(dims, fa):
        name = "mtp.layers.0." + rel.removeprefix(f"layers.{fa}.")
        layer = mtp_layer if init.kind == "router" else init.layer
        out.append((name, dataclasses.replace(init, key="mtp." + name, layer=layer)))
    return out


def mtp_entries(src: WeightSource, dims: ModelDims, dtype: str) -> list[TensorEntry]:
    """Every tensor of the head, encoded as `dtype`, experts in the family's hub layout."""
    entries = [TensorEntry(name, ST_DTYPES[dtype], init.shape, partial(src.stored_blocks, init, dtype))
               for name, init in mtp_inits(dims)]
    layer, n = dims.num_hidden_layers, dims.num_experts
    p = "mtp.layers.0.mlp.experts."
    if family(dims.family).per_expert_mtp:
        for e in range(n):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                init = dataclasses.replace(expert_init(dims, layer, e, proj),
                                           key=f"mtp.{p}{e}.{proj}.weight")
                entries.append(TensorEntry(f"{p}{e}.{proj}.weight", ST_DTYPES[dtype], init.shape,
                                           partial(src.stored_blocks, init, dtype)))
        return entries

    def stacked(*projs: str) -> Iterator[np.ndarray]:
        for e in range(n):
            parts = [np.concatenate(list(src.stored_blocks(dataclasses.replace(
                expert_init(dims, layer, e, pr), key=f"mtp.{p}{e}.{pr}.weight"), dtype)), axis=0)
                for pr in projs]
            yield np.concatenate(parts, axis=0)[None]

    i, h = dims.moe_intermediate_size, dims.hidden_size
    return [*entries,
            TensorEntry(p + "gate_up_proj", ST_DTYPES[dtype], (n, 2 * i, h),
                        lambda: stacked("gate_proj", "up_proj")),
            TensorEntry(p + "down_proj", ST_DTYPES[dtype], (n, h, i), lambda: stacked("down_proj"))]
