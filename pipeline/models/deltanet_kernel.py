"""Gated DeltaNet's recurrence as one CUDA kernel: mlx-lm's Metal kernel, ported.

mlx-lm runs the recurrence as one kernel only on Metal (`mlx_lm.models.gated_delta`); on
CUDA it takes the ops path, a loop of ops per token: every decode token costs each
DeltaNet layer a compiled step of several kernels, and a prompt of T tokens costs T of
them per layer, each holding state-sized float32 arrays (2 MiB a step at the 35B's dims)
until it has run, which on a GPU is after the host has encoded the whole slice
(pipeline/prefill_slices.py). The kernel keeps each state row in registers over the
tokens: one launch per layer and call, temporaries the size of its output.

`install()` points mlx-lm's `gated_delta_ops` (which its `gated_delta_update` looks up
at call time for every family that uses it: Qwen3-Next, Qwen3.5/3.6, ...) at `ops`,
which runs the kernel where it applies (a CUDA GPU, scalar gates, Dk a multiple of 32)
and mlx-lm's ops otherwise. The process's every model takes it, the resident mlx-lm
reference of `moestream bench` too, so their comparisons stay like for like.
`MOESTREAM_DELTANET_KERNEL=0` (or off, false, no) keeps mlx-lm's ops (as MLX_GDN_PACKED=0
does for mlx-lm's packed Metal kernel).

The arithmetic is the ops path's, in float32 (decay, the state's product with k summed
over Dk, the delta, the update, the output summed over Dk): only the order of the Dk sums
differs (a warp's butterfly), so the logits move at float32 rounding, not more.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx

ENV = "MOESTREAM_DELTANET_KERNEL"
LANES = 32  # a warp: one value row of the state, Dk / 32 elements a lane
ROWS_PER_BLOCK = 4

# One warp per (sequence, value head, value row): lane `x` holds the row's elements
# [x * Dk/32, (x + 1) * Dk/32). T is the tokens of this call (q's second axis).
SOURCE = r"""
    const int T = q_shape[1];
    const int lane = threadIdx.x;
    const int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
    const int n = blockIdx.z;
    const int b_idx = n / Hv;
    const int hv_idx = n % Hv;
    const int hk_idx = hv_idx / (Hv / Hk);
    constexpr int n_per_t = Dk / 32;

    // q, k: [B, T, Hk, Dk]; v, y: [B, T, Hv, Dv]; g, beta: [B, T, Hv]; mask: [B, T]
    const InT* q_ = q + (size_t)b_idx * T * Hk * Dk + hk_idx * Dk + n_per_t * lane;
    const InT* k_ = k + (size_t)b_idx * T * Hk * Dk + hk_idx * Dk + n_per_t * lane;
    const InT* v_ = v + (size_t)b_idx * T * Hv * Dv + hv_idx * Dv;
    InT* y_ = y + (size_t)b_idx * T * Hv * Dv + hv_idx * Dv;
    const GT* g_ = g + (size_t)b_idx * T * Hv;
    const BT* beta_ = beta + (size_t)b_idx * T * Hv;

    // state_in, state_out: [B, Hv, Dv, Dk]
    const StT* i_state = state_in + ((size_t)n * Dv + dv_idx) * Dk + n_per_t * lane;
    StT* o_state = state_out + ((size_t)n * Dv + dv_idx) * Dk + n_per_t * lane;

    float state[n_per_t];
    #pragma unroll
    for (int i = 0; i < n_per_t; ++i) {
      state[i] = static_cast<float>(i_state[i]);
    }

    for (int t = 0; t < T; ++t) {
      if (MASKED_STEP) {
        const float gt = static_cast<float>(g_[hv_idx]);
        float kv_mem = 0.0f;
        #pragma unroll
        for (int i = 0; i < n_per_t; ++i) {
          state[i] = state[i] * gt;
          kv_mem += state[i] * static_cast<float>(k_[i]);
        }
        #pragma unroll
        for (int o = 16; o > 0; o /= 2) {
          kv_mem += __shfl_xor_sync(0xffffffff, kv_mem, o);
        }
        const float delta = (static_cast<float>(v_[dv_idx]) - kv_mem) * static_cast<float>(beta_[hv_idx]);
        float out = 0.0f;
        #pragma unroll
        for (int i = 0; i < n_per_t; ++i) {
          state[i] = state[i] + static_cast<float>(k_[i]) * delta;
          out += state[i] * static_cast<float>(q_[i]);
        }
        #pragma unroll
        for (int o = 16; o > 0; o /= 2) {
          out += __shfl_xor_sync(0xffffffff, out, o);
        }
        if (lane == 0) {
          y_[dv_idx] = static_cast<InT>(out);
        }
      } else if (lane == 0) {
        y_[dv_idx] = static_cast<InT>(0.0f);
      }
      q_ += Hk * Dk;
      k_ += Hk * Dk;
      v_ += Hv * Dv;
      y_ += Hv * Dv;
      g_ += Hv;
      beta_ += Hv;
    }
    #pragma unroll
    for (int i = 0; i < n_per_t; ++i) {
      o_state[i] = static_cast<StT>(state[i]);
    }
"""

_kernels: dict[bool, Any] = {}
_original: Callable[..., tuple[mx.array, mx.array]] | None = None


OFF = frozenset({"0", "off", "false", "no"})


def enabled() -> bool:
    """Whether this process runs the recurrence as the kernel where it applies."""
    return (os.environ.get(ENV, "1").strip().lower() not in OFF and mx.default_device() == mx.gpu
            and mx.cuda.is_available())


def applies(k: mx.array, g: mx.array) -> bool:
    """The kernel's shapes: scalar gates ([B, T, Hv]) and Dk a multiple of a warp (<= 256)."""
    dk = k.shape[-1]
    return g.ndim == 3 and dk % LANES == 0 and dk <= 8 * LANES and enabled()


def _kernel(masked: bool) -> Any:
    kernel = _kernels.get(masked)
    if kernel is None:
        names = ["q", "k", "v", "g", "beta", "state_in"] + (["mask"] if masked else [])
        step = "mask[b_idx * T + t]" if masked else "true"
        kernel = _kernels[masked] = mx.fast.cuda_kernel(
            name="moestream_gated_delta" + ("_mask" if masked else ""), input_names=names,
            output_names=["y", "state_out"], source=SOURCE.replace("MASKED_STEP", step))
    return kernel


def recurrence(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
               mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """The kernel: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state
    [B, Hv, Dv, Dk]; mask [B, T] or None. Returns y [B, T, Hv, Dv] and the new state."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2:]
    # The kernel reads by these shapes without bounds checks (the ops path would raise).
    if (q.shape != k.shape or v.shape[:2] != (b, t) or hv % hk or state.shape != (b, hv, dv, dk)
            or g.shape != (b, t, hv) or beta.shape != (b, t, hv)
            or (mask is not None and mask.shape != (b, t))):
        raise ValueError(f"gated delta kernel: shapes q {q.shape} k {k.shape} v {v.shape} g {g.shape} "
                         f"beta {beta.shape} state {state.shape} mask {None if mask is None else mask.shape}")
    inputs = [q, k, v, g, beta, state] + ([] if mask is None else [mask])
    rows = ROWS_PER_BLOCK if dv % ROWS_PER_BLOCK == 0 else 1
    y, new_state = _kernel(mask is not None)(
        inputs=inputs,
        template=[("InT", q.dtype), ("StT", state.dtype), ("GT", g.dtype), ("BT", beta.dtype),
                  ("Dk", dk), ("Dv", dv), ("Hk", hk), ("Hv", hv)],
        grid=(LANES, dv, b * hv), threadgroup=(LANES, rows, 1),
        output_shapes=[(*v.shape[:2], hv, dv), state.shape], output_dtypes=[q.dtype, state.dtype])
    return y, new_state


def ops(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array | None = None,
        mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """mlx-lm's `gated_delta_ops`, as the kernel where it applies."""
    assert _original is not None
    if state is None or not applies(k, g):
        return _original(q, k, v, g, beta, state, mask)
    return recurrence(q, k, v, g, beta, state, mask)


def install() -> None:
    """Route mlx-lm's ops path through `ops` (idempotent; nothing changes off CUDA)."""
    global _original
    from mlx_lm.models import gated_delta

    if _original is None:
        _original = gated_delta.gated_delta_ops
        gated_delta.gated_delta_ops = ops
