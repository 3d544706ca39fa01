"""A prefill chunk's attention and DeltaNet mixers run in slices: temporaries bounded.

A prefill chunk is as long as the pool allows (up to compute.prefill_max_tokens): each
chunk reads every expert its tokens route to once per layer, so long chunks read the
disk least. But the mixers' temporaries grow with the chunk. mlx-lm's Gated DeltaNet
recurrence without its Metal kernel (MLX's CPU backend, and CUDA) is a loop of ops whose
per-step states stay alive until the layer is evaluated: 2.1 MiB per token at the 35B
dims (558 MiB for 256 tokens, measured; docs/memory.md); attention's scores grow with
tokens x context. So the mixer of a layer runs over slices of `slice_tokens` tokens,
each evaluated (with its cache) before the next: the same recurrence and the same
causal attention over the cache, with the experts still read once per chunk.

Only single sequences are sliced (mask None or "causal"); batched prefill with padding
masks runs whole.

A MoE layer's routed experts grow with the chunk too: one row per (token, chosen expert)
for the tokens sorted by expert, each projection's output and the unsorting (~0.25 MiB a
token at the 35B's dims in float32: 390 MiB of temporaries for a 1024-token chunk,
measured). Every token's MoE output is its own, so the MoE half runs over slices of
`moe_slice_tokens` tokens too (`moe`), each evaluated before the next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from pipeline.models import deltanet_kernel

MIB = 2**20
# What stays out of the slices' share: sized for the lm_head when its scales were cast to
# float32 at every step (62 MiB at a 248k vocabulary on the CPU). They are widened once at
# load now (pipeline/models/dense.py `widen_head`), so this is headroom the measured
# temporaries (docs/memory.md) were taken with; lowering it widens the slices.
HEAD_RESERVE = 64 * MIB
MIN_SLICE = 16
# Arrays as long as the whole chunk that live beside a slice: the residual stream, its
# sum after the mixer, the normed input, and the mixer's or MoE half's output being put
# together (`residual_bytes`). Not counted, a 512-token prompt's temporaries at the 35B's
# dims were 155 MiB against the 150 share (session 30: 43-token DeltaNet slices of 90 MiB
# beside 20-50 MiB of the chunk's own arrays and states).
CHUNK_ARRAYS = 4


# On a GPU backend MLX keeps every op's inputs alive until its kernel has run
# (mlx/backend/cuda/eval.cpp: "Keep used buffers alive until kernel finishes running"), and
# the host encodes a slice's recurrence far ahead of a GPU busy computing it: each step's
# state-sized float32 arrays (the decayed state, it times k, the update, the new state, it
# times q) then stay until the slice completes, where the CPU backend frees each as the
# next step runs (one state a step, measured: docs/memory.md). On the H100 (session 34) a
# 1024-token prompt's temporaries were 521 MiB on CUDA against 133 on the CPU, the slices
# sized for the CPU's one state a step. Only the ops path holds them: on CUDA the recurrence
# is one kernel (pipeline/models/deltanet_kernel.py) unless MOESTREAM_DELTANET_KERNEL=0, and
# sized for five states its slices cost a fifth of the prefill for 24 MiB (session 35).
HELD_STEP_ARRAYS = 5


def per_token_bytes(layers: list[Any], context: int, held: bool | None = None) -> int:
    """Temporaries one prompt token adds to the largest mixer: a DeltaNet step's state on
    the ops path (float32; `HELD_STEP_ARRAYS` of them where a GPU backend holds a step's
    arrays until the slice has run: `held`, by default whether the device is a GPU), or a
    row of attention scores over `context` keys."""
    gpu = mx.default_device() == mx.gpu
    kernel = gpu and (mx.metal.is_available() or deltanet_kernel.enabled())  # mlx-lm's, or ours on CUDA
    held = gpu if held is None else held
    worst = 0
    for block in layers:
        if getattr(block, "is_linear", False):
            la = block.linear_attn
            step = la.num_v_heads * la.head_v_dim * la.head_k_dim * 4 * (HELD_STEP_ARRAYS if held else 1)
            worst = max(worst, (la.num_v_heads * la.head_v_dim * 16) if kernel else step)
        else:
            # Families name their attention's head count differently (mlx-lm's modules).
            attn = getattr(block, "self_attn", None)
            heads = next((getattr(attn, n) for n in ("num_attention_heads", "n_heads", "num_heads")
                          if isinstance(getattr(attn, n, None), int)), 64)
            worst = max(worst, heads * context * 4 * 2)  # scores + softmax
    return max(worst, 1)


def slice_tokens(layers: list[Any], temporaries_bytes: int, context: int, chunk_bytes: int = 0) -> int:
    """Tokens per mixer slice for the temporaries' share (memory.temporaries_mb)."""
    return tokens_within(per_token_bytes(layers, context), temporaries_bytes, chunk_bytes)


def tokens_within(token_bytes: int, temporaries_bytes: int, chunk_bytes: int = 0) -> int:
    """Tokens whose temporaries (`token_bytes` each) fit the temporaries' share, less the
    head's reserve and the longest chunk's own arrays (`chunk_bytes`: `residual_bytes`):
    a mixer's slice, or a MoE half's (`moe_token_bytes`)."""
    room = max(temporaries_bytes - HEAD_RESERVE - chunk_bytes, temporaries_bytes // 4)
    return max(MIN_SLICE, room // max(token_bytes, 1))


def residual_bytes(tokens: int, hidden: int, itemsize: int) -> int:
    """What a chunk of `tokens` holds whole beside its slices (CHUNK_ARRAYS of [T, hidden])."""
    return CHUNK_ARRAYS * tokens * hidden * itemsize


def moe_token_bytes(top_k: int, hidden: int, intermediate: int, itemsize: int) -> int:
    """Temporaries one prompt token adds to a MoE layer: per chosen expert its input row
    sorted by expert, the down projection's output and its unsorting (hidden wide), and
    the up, gate and activation rows (intermediate wide); then the weighted sum."""
    return top_k * (3 * hidden + 3 * intermediate) * itemsize + hidden * itemsize


def moe(fn: Callable[[mx.array, mx.array, mx.array], mx.array], x: mx.array, slots: mx.array,
        scores: mx.array, tokens: int) -> mx.array:
    """`fn(x, slots, scores)` (x [rows, T, H], slots and scores [rows, T, k]) over slices of
    at most `tokens` tokens when T is longer, each evaluated before the next."""
    length = x.shape[-2]
    if length <= tokens:
        return fn(x, slots, scores)
    outs = []
    for start in range(0, length, tokens):
        part = slice(start, start + tokens)
        y = fn(x[..., part, :], slots[..., part, :], scores[..., part, :])
        mx.eval(y)
        outs.append(y)
    return mx.concatenate(outs, axis=-2)


def mix(mixer: Any, x: mx.array, mask: Any, cache: Any, tokens: int) -> mx.array:
    """`mixer(x, mask, cache)`, over slices of at most `tokens` tokens when it is long."""
    length = x.shape[1]
    if length <= tokens or not (mask is None or isinstance(mask, str)):
        return mixer(x, mask, cache)
    outs = []
    for start in range(0, length, tokens):
        part = x[:, start : start + tokens]
        y = mixer(part, mask if part.shape[1] > 1 else None, cache)
        mx.eval(y, cache.state)  # a tree: MLX skips what is not an array
        outs.append(y)
    return mx.concatenate(outs, axis=1)
