"""Deterministic random weights for synthetic checkpoints, generated block by block.

Every logical tensor has a key (e.g. `layers.3.mlp.experts.7.up_proj`) and its values come
from `np.random.Generator(PCG64(seed, key, block))`, so the same seed gives the same values in
every layout (fused or per-expert, HF or MLX) and byte-identical files. Values are drawn
through a 65536-entry table of standard-normal quantiles indexed by random 16-bit words:
as good as a Gaussian for these purposes and several times faster than `standard_normal`,
which matters when writing 160 GB.

Scales (why the model gives finite, non-degenerate logits):
- Linear weights have std 1/sqrt(fan_in), so activations stay O(1).
- Output projections (o_proj, out_proj, down_proj) are further scaled by 1/sqrt(2 * layers):
  the residual stream then changes slowly from layer to layer, as in trained models, which
  is what makes next-layer expert prediction meaningful.
- Zero-centred RMSNorm weights (stored as offsets from 1 by the hub) are N(0, 0.02); the
  gated DeltaNet norm (stored as is) is 1 + N(0, 0.02).
- A = exp(A_log) ~ U(0.5, 4) and dt_bias ~ N(-1, 0.5): per-step decays between ~0.3 and ~0.9,
  a recurrent state that remembers a few tokens.

Routers (why caching and prediction are meaningful):
- Each layer's router rows get a log-normal scale, and a few "popular" experts per layer a
  larger one: larger rows win top-k more often, so expert use is skewed but not degenerate.
- Layer l's router is 0.5 * (layer l-1's router, rows permuted) + sqrt(0.75) * fresh noise:
  adjacent layers' routers are correlated through a fixed expert permutation, as routing in
  trained models is correlated across layers (the `transition` prefetch strategy learns it).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

BLOCK_ELEMS = 1 << 22  # values per RNG block: bounds memory, fixes the random stream
ROUTER_CORRELATION = 0.5
NORM_STD = 0.02

_lut: np.ndarray | None = None


def normal_lut() -> np.ndarray:
    """65536 quantiles of N(0, 1), rescaled to unit variance (float32)."""
    global _lut
    if _lut is None:
        nd = NormalDist()
        q = np.array([nd.inv_cdf((i + 0.5) / 65536) for i in range(65536)], dtype=np.float64)
        _lut = (q / q.std()).astype(np.float32)
    return _lut


def rng_for(seed: int, key: str) -> np.random.Generator:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return np.random.Generator(np.random.PCG64([seed, int.from_bytes(digest, "little")]))


def normal_block(seed: int, key: str, n: int) -> np.ndarray:
    rng = rng_for(seed, key)
    idx = np.frombuffer(rng.bytes(2 * n), dtype=np.uint16)
    return normal_lut()[idx]


@dataclass(frozen=True)
class Init:
    """How to fill one logical tensor."""

    key: str
    shape: tuple[int, ...]
    kind: str  # "normal" | "a_log" | "router"
    std: float = 1.0
    mean: float = 0.0
    layer: int = -1  # for "router"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def rows_per_block(self) -> int:
        row = math.prod(self.shape[1:]) if len(self.shape) > 1 else self.shape[0]
        return self.shape[0] if len(self.shape) == 1 else max(1, BLOCK_ELEMS // max(row, 1))


class WeightSource:
    """Produces the float32 values of logical tensors, in row blocks."""

    def __init__(self, seed: int, num_experts: int, hidden: int) -> None:
        self.seed = seed
        self.num_experts = num_experts
        self.hidden = hidden
        self._router_raw: tuple[int, np.ndarray] | None = None

    def blocks(self, init: Init) -> Iterator[np.ndarray]:
        """Row blocks of `init`'s tensor (float32, shape [rows, *shape[1:]])."""
        if init.kind == "router":
            yield self.router(init.layer) * np.float32(init.std)
            return
        if init.kind == "a_log":
            rng = rng_for(self.seed, init.key)
            yield np.log(rng.uniform(0.5, 4.0, size=init.shape)).astype(np.float32)
            return
        rows = init.rows_per_block()
        tail = init.shape[1:]
        row_elems = math.prod(tail) if tail else 1
        for b, start in enumerate(range(0, init.shape[0], rows)):
            n = min(rows, init.shape[0] - start)
            vals = normal_block(self.seed, f"{init.key}#{b}", n * row_elems)
            vals *= np.float32(init.std)
            if init.mean:
                vals += np.float32(init.mean)
            yield vals.reshape((n, *tail))

    def stored_blocks(self, init: Init, dtype: str) -> Iterator[np.ndarray]:
        """`blocks(init)` already encoded as `dtype` (see `to_storage`), bit for bit.

        For normal tensors the scaled table is encoded once and indexed: the same float32
        arithmetic per value, one pass instead of four.
        """
        if init.kind != "normal":
            for block in self.blocks(init):
                yield to_storage(block, dtype)
            return
        table = normal_lut() * np.float32(init.std)
        if init.mean:
            table += np.float32(init.mean)
        table = to_storage(table, dtype)
        rows = init.rows_per_block()
        tail = init.shape[1:]
        row_elems = math.prod(tail) if tail else 1
        for b, start in enumerate(range(0, init.shape[0], rows)):
            n = min(rows, init.shape[0] - start)
            rng = rng_for(self.seed, f"{init.key}#{b}")
            idx = np.frombuffer(rng.bytes(2 * n * row_elems), dtype=np.uint16)
            yield table[idx].reshape((n, *tail))

    def full(self, init: Init) -> np.ndarray:
        return np.concatenate(list(self.blocks(init)), axis=0)

    def router(self, layer: int) -> np.ndarray:
        """Layer `layer`'s router weight [E, H] with unit-scale rows (times popularity)."""
        raw = self._raw(layer)
        e = self.num_experts
        rng = rng_for(self.seed, f"router.popularity.{layer}")
        scale = np.exp(rng.normal(0.0, 0.3, size=e))
        popular = rng.choice(e, size=max(1, e // 16), replace=False)
        scale[popular] *= 1.8
        return (raw * (scale[:, None] / math.sqrt(self.hidden))).astype(np.float32)

    def _raw(self, layer: int) -> np.ndarray:
        # The chain is computed in layer order and only the last link is kept: writing goes
        # layer by layer, so this is O(E*H) memory and O(1) work per layer.
        if self._router_raw is not None and self._router_raw[0] == layer:
            return self._router_raw[1]
        if self._router_raw is not None and self._router_raw[0] == layer - 1:
            prev = self._router_raw[1]
        elif layer > 0:
            prev = self._raw(layer - 1)
        else:
            prev = None
        shape = (self.num_experts, self.hidden)
        fresh = normal_block(self.seed, f"router.{layer}", math.prod(shape)).reshape(shape)
        if prev is None:
            raw = fresh
        else:
            perm = rng_for(self.seed, f"router.perm.{layer}").permutation(self.num_experts)
            c = ROUTER_CORRELATION
            raw = (c * prev[perm] + math.sqrt(1 - c * c) * fresh).astype(np.float32)
        self._router_raw = (layer, raw)
        return raw


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even); returns the uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    return ((u + rounding) >> 16).astype(np.uint16)


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the array whose bytes are `dtype`'s encoding."""
    if dtype == "bfloat16":
        return f32_to_bf16_bits(x)
    if dtype == "float16":
        return x.astype(np.float16)
    if dtype == "float32":
        return np.ascontiguousarray(x, dtype=np.float32)
    raise ValueError(f"unsupported dtype {dtype!r}: expected bfloat16, float16 or float32")
