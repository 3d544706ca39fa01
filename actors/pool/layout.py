"""Where each MoE layer's expert tensors live in the pool, when layers differ in format.

Mixed-precision checkpoints (mlx-lm's `mixed_3_6` gives down_proj 6 bits in some layers,
3 in the others) have layers whose experts differ in shape. The pool keeps one slot array
per distinct (tensor, dtype, shape), so every slot can hold an expert of any layer and the
slot table stays one pool with one eviction order. A slot therefore costs the sum of
every variant's bytes — the budget buys that many slots, never more memory than asked.
When every layer agrees (the usual case) there is one variant per tensor, exactly the
plain layout.

`widen="float32"` keeps float16/bfloat16 scales and biases as float32 in the pool. With
float32 activations (MLX's CPU backend) `gather_qmm` otherwise casts the *whole* slot
array of each projection's scales and biases to float32 on every call: 234 MiB of
temporaries per MoE layer with a 1 GiB pool at the 35B dims (docs/memory.md). Widened
once at install instead, a slot costs 11% more and a call casts nothing; the values are
the same (float16/bfloat16 -> float32 is exact), so the logits are too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from qpack.spec import ExpertFormat, TensorSpec

_WIDENABLE = ("float16", "bfloat16")


def _variant(t: TensorSpec) -> tuple[str, str, tuple[int, ...]]:
    return t.name, t.dtype, tuple(t.shape)


def widen_for(activation_dtype: object) -> str | None:
    """The dtype the pool keeps scales and biases in for these activations (None: as stored)."""
    import mlx.core as mx

    # None (the model's own dtype) compares to no Dtype: MLX's __eq__ refuses it.
    return "float32" if activation_dtype is not None and activation_dtype == mx.float32 else None


def _stored(t: TensorSpec, widen: str | None) -> tuple[str, int]:
    """(dtype, nbytes) of `t` in the pool."""
    if widen and t.dtype in _WIDENABLE and t.name.endswith((".scales", ".biases")):
        return widen, t.nbytes // 2 * 4
    return t.dtype, t.nbytes


class PoolLayout:
    """layer -> (its format, tensor name -> pool array name); the arrays' specs."""

    def __init__(self, formats: Mapping[int | None, ExpertFormat], widen: str | None = None) -> None:
        if not formats:
            raise ValueError("a pool layout needs at least one expert format")
        self.formats = dict(formats)
        self.widen = widen
        self.arrays: dict[str, tuple[str, tuple[int, ...], int]] = {}  # name -> dtype, shape, nbytes
        self.names: dict[int | None, dict[str, str]] = {}
        seen: dict[tuple[str, str, tuple[int, ...]], str] = {}
        for layer, fmt in self.formats.items():
            names = {}
            for t in fmt.tensors:
                v = _variant(t)
                if v not in seen:
                    taken = sum(1 for n in self.arrays if n.split("@")[0] == t.name)
                    seen[v] = t.name if not taken else f"{t.name}@{taken}"
                    self.arrays[seen[v]] = (_stored(t, widen)[0], tuple(t.shape), _stored(t, widen)[1])
                names[t.name] = seen[v]
            self.names[layer] = names
        self.max_nbytes = max(fmt.nbytes for fmt in self.formats.values())

    @classmethod
    def uniform(cls, fmt: ExpertFormat, widen: str | None = None) -> PoolLayout:
        """Every layer in one format (what a plain container has)."""
        return cls({None: fmt}, widen)

    @classmethod
    def of(cls, layers: Iterable[object], widen: str | None = None) -> PoolLayout:
        """From manifest layer entries (`.index`, `.format`)."""
        # Typed `object`: actors does not import qpack's manifest types for this one read.
        formats = {entry.index: entry.format for entry in layers}  # type: ignore[attr-defined]
        if len(set(formats.values())) == 1:
            return cls.uniform(next(iter(formats.values())), widen)
        return cls(formats, widen)

    @property
    def mixed(self) -> bool:
        return len(self.formats) > 1

    @property
    def slot_nbytes(self) -> int:
        """What one slot costs: every variant of every tensor."""
        return sum(n for _, _, n in self.arrays.values())

    def layer(self, layer: int | None) -> tuple[ExpertFormat, dict[str, str]]:
        """(format, tensor name -> array name) of `layer`'s experts."""
        key = layer if layer in self.formats else None
        if key not in self.formats:
            raise KeyError(f"no expert format for layer {layer}")
        return self.formats[key], self.names[key]
