"""Where each MoE layer's expert tensors live in the pool, when layers differ in format.

Mixed-precision checkpoints (mlx-lm's `mixed_3_6` gives down_proj 6 bits in some layers,
3 in the others) have layers whose experts differ in shape. The pool keeps one slot array
per distinct (tensor, dtype, shape), so every slot can hold an expert of any layer and the
slot table stays one pool with one eviction order. A slot therefore costs the sum of
every variant's bytes — the budget buys that many slots, never more memory than asked.
When every layer agrees (the usual case) there is one variant per tensor, exactly the
plain layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from qpack.spec import ExpertFormat, TensorSpec


def _variant(t: TensorSpec) -> tuple[str, str, tuple[int, ...]]:
    return t.name, t.dtype, tuple(t.shape)


class PoolLayout:
    """layer -> (its format, tensor name -> pool array name); the arrays' specs."""

    def __init__(self, formats: Mapping[int | None, ExpertFormat]) -> None:
        if not formats:
            raise ValueError("a pool layout needs at least one expert format")
        self.formats = dict(formats)
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
                    self.arrays[seen[v]] = (t.dtype, tuple(t.shape), t.nbytes)
                names[t.name] = seen[v]
            self.names[layer] = names
        self.max_nbytes = max(fmt.nbytes for fmt in self.formats.values())

    @classmethod
    def uniform(cls, fmt: ExpertFormat) -> PoolLayout:
        """Every layer in one format (what a plain container has)."""
        return cls({None: fmt})

    @classmethod
    def of(cls, layers: Iterable[object]) -> PoolLayout:
        """From manifest layer entries (`.index`, `.format`)."""
        # Typed `object`: actors does not import qpack's manifest types for this one read.
        formats = {entry.index: entry.format for entry in layers}  # type: ignore[attr-defined]
        if len(set(formats.values())) == 1:
            return cls.uniform(next(iter(formats.values())))
        return cls(formats)

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
