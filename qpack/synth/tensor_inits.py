"""Which initial distribution each synthetic tensor gets: scaled so activations keep a sane
size through the layers (random weights, real layouts). The dense tensors of a layer are
the family's (qpack.families); the routed experts are the same everywhere."""

from __future__ import annotations

import math

from qpack.families import family
from qpack.synth.dims import ModelDims
from qpack.synth.init_weights import Init


def dense_inits(dims: ModelDims, layer: int) -> list[tuple[str, Init]]:
    """One decoder layer's tensors except the routed experts: (name under the text model, init)."""
    return family(dims.family).dense_inits(dims, layer)


def expert_init(dims: ModelDims, layer: int, expert: int, proj: str) -> Init:
    h, i = dims.hidden_size, dims.moe_intermediate_size
    key = f"layers.{layer}.mlp.experts.{expert}.{proj}.weight"
    if proj == "down_proj":
        res = 1.0 / math.sqrt(2 * dims.num_hidden_layers)
        return Init(key, (h, i), "normal", res / math.sqrt(i))
    return Init(key, (i, h), "normal", 1.0 / math.sqrt(h))
