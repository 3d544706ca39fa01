"""The streamed sparse-MoE block's routed experts, taken from pool slots.

The routed experts live in the pool's slot arrays ([slots, ...] per tensor), so the
expert matmuls are mlx-lm's own `gather_qmm`/`gather_mm` calls with slot indices in
place of expert indices. Same kernels, same order of operations: logits do not depend
on which slot an expert happens to occupy, so they are bit-identical across pool sizes.
The router and the rest of the block (shared experts) are the family's
(pipeline/models/families).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models.activations import swiglu

from qpack.spec import ExpertFormat

# mlx-lm sorts tokens by expert once a batch has this many (token, expert) pairs.
SORT_THRESHOLD = 64


def _gather_sort(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Rows sorted by expert (mlx-lm's switch_layers does the same, privately)."""
    *_, k = indices.shape
    flat = indices.flatten()
    order = mx.argsort(flat)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // k], flat[order], inv_order


def _scatter_unsort(x: mx.array, inv_order: mx.array, shape: tuple[int, ...]) -> mx.array:
    return mx.unflatten(x[inv_order], 0, shape)


_LHS: dict[tuple[tuple[int, ...], tuple[int, ...]], mx.array] = {}
_LHS_SHAPES = 64  # decode shapes (rows x tokens x top-k) are few; the cache starts over past this


def lhs_indices(x_shape: tuple[int, ...], idx_shape: tuple[int, ...]) -> mx.array:
    """`gather_qmm`'s default `lhs_indices` for an x of `x_shape` ([..., 1, 1, H]) and
    slots of `idx_shape`: each row of x for every one of its slots (an arange over x's
    batch dimensions broadcast with the slots), as one contiguous uint32 array made on
    the host once per shape. Left to MLX it is made per call, an arange and the
    broadcast's copy (H100, session 33: kernels a decode token runs beside its three
    projections a MoE layer); the same values, so the same products."""
    key = (x_shape[:-2], idx_shape)
    lhs = _LHS.get(key)
    if lhs is None:
        batch = x_shape[:-2]
        rows = np.arange(int(np.prod(batch)), dtype=np.uint32).reshape(batch)
        if len(_LHS) >= _LHS_SHAPES:
            _LHS.clear()
        host = np.broadcast_to(rows, np.broadcast_shapes(batch, idx_shape))
        lhs = _LHS[key] = mx.array(np.ascontiguousarray(host))
    return lhs


def _project(
    arrays: dict[str, mx.array], fmt: ExpertFormat, proj: str, x: mx.array, idx: mx.array, sort: bool
) -> mx.array:
    bits, group_size, mode = fmt.quant(proj)  # mixed-precision layers differ per projection
    # x's own rows: [..., 1, 1, H] for gate and up, [..., k, 1, I] (one per slot) for down
    lhs = None if sort else lhs_indices(x.shape, idx.shape)
    if bits is None:
        out = mx.gather_mm(
            x, arrays[f"{proj}.weight"].swapaxes(-1, -2), lhs_indices=lhs, rhs_indices=idx,
            sorted_indices=sort,
        )
    else:
        out = _qmm(arrays, proj, x, idx, sort, bits, group_size, mode, lhs)
    bias = arrays.get(f"{proj}.bias")  # SwitchLinear(bias=True): gpt-oss, added as mlx-lm adds it
    return out if bias is None else out + mx.expand_dims(bias[idx], -2)


def _qmm(arrays: dict[str, mx.array], proj: str, x: mx.array, idx: mx.array, sort: bool,
         bits: int, group_size: int | None, mode: str | None, lhs: mx.array | None) -> mx.array:
    return mx.gather_qmm(
        x,
        arrays[f"{proj}.weight"],
        arrays[f"{proj}.scales"],
        arrays.get(f"{proj}.biases"),
        lhs_indices=lhs,
        rhs_indices=idx,
        transpose=True,
        group_size=group_size,
        bits=bits,
        mode=mode or "affine",
        sorted_indices=sort,
    )


Activation = Callable[[mx.array, mx.array], mx.array]  # (gate, up) -> hidden


def routed_experts(
    arrays: dict[str, mx.array], fmt: ExpertFormat, x: mx.array, slots: mx.array,
    activation: Activation = swiglu,
) -> mx.array:
    """SwitchGLU over pool slots: x [..., H], slots [..., k] -> [..., k, H]. `activation`:
    the family's (mlx-lm's SwiGLU; gpt-oss's clamped variant)."""
    x = mx.expand_dims(x, (-2, -3))
    sort = slots.size >= SORT_THRESHOLD
    idx, inv_order = slots, None
    if sort:
        x, idx, inv_order = _gather_sort(x, slots)
    up = _project(arrays, fmt, "up_proj", x, idx, sort)
    gate = _project(arrays, fmt, "gate_proj", x, idx, sort)
    x = _project(arrays, fmt, "down_proj", activation(gate, up), idx, sort)
    if inv_order is not None:  # sorted
        x = _scatter_unsort(x, inv_order, slots.shape)
    return x.squeeze(-2)
