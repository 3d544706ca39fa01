"""The streamed sparse-MoE block: mlx-lm's routing math, experts taken from pool slots.

The routed experts live in the pool's slot arrays ([slots, ...] per tensor), so the
expert matmuls are mlx-lm's own `gather_qmm`/`gather_mm` calls with slot indices in
place of expert indices. Same kernels, same order of operations: logits do not depend
on which slot an expert happens to occupy, so they are bit-identical across pool sizes.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from qpack.spec import ExpertFormat

# mlx-lm sorts tokens by expert once a batch has this many (token, expert) pairs.
SORT_THRESHOLD = 64


def route(mlp: nn.Module, x: mx.array, forced: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Top-k expert ids and their weights, exactly as mlx-lm's Qwen3NextSparseMoeBlock.

    `forced` (benchmark-only calibrated routing, pipeline/models/routing_override.py)
    replaces the ids; their weights are still the router's softmax at those ids."""
    gates = mx.softmax(mlp.gate(x), axis=-1, precise=True)
    k = mlp.top_k
    if forced is None:
        inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    else:
        # Evaluating the ids must still evaluate everything before this router (the
        # per-layer sync is what finishes the layers that read pool slots before the
        # pool overwrites them): constant ids would leave that graph lazy.
        inds = mx.depends(forced, gates)
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if mlp.norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores


def _gather_sort(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Rows sorted by expert (mlx-lm's switch_layers does the same, privately)."""
    *_, k = indices.shape
    flat = indices.flatten()
    order = mx.argsort(flat)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // k], flat[order], inv_order


def _scatter_unsort(x: mx.array, inv_order: mx.array, shape: tuple[int, ...]) -> mx.array:
    return mx.unflatten(x[inv_order], 0, shape)


def _project(
    arrays: dict[str, mx.array], fmt: ExpertFormat, proj: str, x: mx.array, idx: mx.array, sort: bool
) -> mx.array:
    bits, group_size, mode = fmt.quant(proj)  # mixed-precision layers differ per projection
    if bits is None:
        return mx.gather_mm(
            x, arrays[f"{proj}.weight"].swapaxes(-1, -2), rhs_indices=idx, sorted_indices=sort
        )
    return mx.gather_qmm(
        x,
        arrays[f"{proj}.weight"],
        arrays[f"{proj}.scales"],
        arrays.get(f"{proj}.biases"),
        rhs_indices=idx,
        transpose=True,
        group_size=group_size,
        bits=bits,
        mode=mode or "affine",
        sorted_indices=sort,
    )


def routed_experts(
    arrays: dict[str, mx.array], fmt: ExpertFormat, x: mx.array, slots: mx.array
) -> mx.array:
    """SwitchGLU over pool slots: x [..., H], slots [..., k] -> [..., k, H]."""
    x = mx.expand_dims(x, (-2, -3))
    sort = slots.size >= SORT_THRESHOLD
    idx, inv_order = slots, None
    if sort:
        x, idx, inv_order = _gather_sort(x, slots)
    up = _project(arrays, fmt, "up_proj", x, idx, sort)
    gate = _project(arrays, fmt, "gate_proj", x, idx, sort)
    x = _project(arrays, fmt, "down_proj", swiglu(gate, up), idx, sort)
    if inv_order is not None:  # sorted
        x = _scatter_unsort(x, inv_order, slots.shape)
    return x.squeeze(-2)


def moe_output(mlp: nn.Module, x: mx.array, routed: mx.array, scores: mx.array) -> mx.array:
    y = (routed * scores[..., None]).sum(axis=-2)
    shared = mlp.shared_expert(x)
    return y + mx.sigmoid(mlp.shared_expert_gate(x)) * shared
