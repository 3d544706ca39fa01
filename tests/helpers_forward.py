"""Test helpers: tiny containers, our streamed forward driven by hand, and mlx-lm's reference.

`DirectForward` runs `ForwardStep` on the calling thread with a plain slot manager of its
own (no actors), so a test sees every layer's output; `Reference` runs mlx-lm's model,
fully resident, layer by layer the way mlx-lm's own `__call__` does.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

from actors.pool.storage import PoolStorage, uniform_format
from pipeline.models.dense import load_dense
from pipeline.models.streamed import ForwardStep, StreamedModel
from qpack.reader import Container

FAMILIES = ("qwen3_next", "qwen3_5_moe")
# Read-only once loaded (the forward never writes to the dense core): shared across tests.
_DENSE: dict[Path, Any] = {}
_REFERENCES: dict[tuple[Path, int | None], Reference] = {}


def tiny_pair(
    synth_checkpoint: Callable[..., Path],
    packed: Callable[..., Path],
    family: str,
    bits: int | None = None,
) -> tuple[Path, Path]:
    """(source checkpoint, our container packed from it), each made once per session.

    bits None: the fp32 hub checkpoint, packed keeping fp32 experts (MLX CPU's gather_mm
    wants fp32). bits 4: the bf16 MLX-quantized checkpoint (what `mlx_lm.convert -q`
    writes), packed as it is. bits 8: the bf16 float checkpoint, packed at 8 bits; its
    reference is mlx-lm's convert path in memory (`Reference(src, quantize=8)`), which the
    packer tests show byte-identical to an MLX-layout 8-bit checkpoint. Both sources are
    the ones tests/test_pack.py synthesizes, so a full run writes them once.
    """
    if bits is None:
        src = synth_checkpoint(family, dtype="float32")
        return src, packed(src, bits=16)
    if bits == 4:
        src = synth_checkpoint(family, dtype="bfloat16", bits=4)
        return src, packed(src)
    src = synth_checkpoint(family, dtype="bfloat16")
    return src, packed(src, bits=bits)


class DirectForward:
    """Our dense core + pool, driven on this thread; experts placed by a seeded random pool.

    Each MoE layer's needed experts are made resident; misses take a random free slot, or
    evict a random resident expert the layer does not need. Different seeds and slot
    counts give different slot assignments for the same computation.
    """

    def __init__(self, qpack: Path, num_slots: int | None = None, seed: int = 0) -> None:
        # The hand-driven forward compares logits, not integrity: the container's sha256 and
        # crc32 checks (~50 ms an open: the tiny dense core is 80 MB at the real vocabulary) are
        # the engine's, tested where the engine opens it (tests/test_faults_disk.py, ...).
        self.container = Container.open(qpack, verify="off")
        manifest = self.container.manifest
        fmt = uniform_format([layer.format for layer in manifest.layers], str(qpack))
        total = manifest.num_experts * len(manifest.layers)
        self.num_slots = total if num_slots is None else num_slots
        if qpack not in _DENSE:
            _DENSE[qpack] = load_dense(self.container.config, self.container.dense_path)
        dense = _DENSE[qpack]
        self.storage = PoolStorage(fmt, self.num_slots)
        self.model = StreamedModel(dense, fmt, self.storage.arrays)
        self.rng = random.Random(seed)
        self.slot_of: dict[tuple[int, int], int] = {}
        self.installs = 0

    def close(self) -> None:
        self.container.close()

    def make_cache(self) -> list[Any]:
        return self.model.make_cache()

    def _place(self, layer: int, experts: Sequence[int]) -> np.ndarray:
        needed = {(layer, int(e)) for e in experts}
        used = set(self.slot_of.values())
        free = [s for s in range(self.num_slots) if s not in used]
        items: list[tuple[int, np.ndarray]] = []
        for key in sorted(needed - self.slot_of.keys()):
            if free:
                slot = free.pop(self.rng.randrange(len(free)))
            else:
                victims = sorted(k for k in self.slot_of if k not in needed)
                assert victims, f"pool of {self.num_slots} slots cannot hold layer {layer}"
                slot = self.slot_of.pop(victims[self.rng.randrange(len(victims))])
            buf = np.empty(self.container.manifest.layer(layer).stride, dtype=np.uint8)
            self.container.read_expert(layer, key[1], buf)
            items.append((slot, buf))
            self.slot_of[key] = slot
        self.storage.install(items)
        self.installs += len(items)
        slot_of = np.full(self.model.num_experts, -1, dtype=np.int32)
        for _, e in needed:
            slot_of[e] = self.slot_of[(layer, e)]
        return slot_of

    def forward(
        self, tokens: Sequence[int], cache: list[Any], *, layer_outputs: bool = False,
        all_positions: bool = True,
    ) -> tuple[mx.array, list[mx.array]]:
        """Logits for every position [T, vocab] (or the last, [1, vocab]: the head over a
        real vocab is most of a tiny model's CPU time), and (if asked) each layer's output
        [1, T, H]."""
        step = ForwardStep(self.model, list(tokens), cache)
        outputs: list[mx.array] = []
        routing = step.run_to_routing()
        while routing is not None:
            slot_of = self._place(routing.layer, np.unique(routing.ids).tolist())
            routing = step.advance(slot_of)
            if layer_outputs:
                # advance() leaves h at the output of every layer before the next routing.
                done = routing.layer if routing is not None else self.model.num_layers
                assert len(outputs) < done
                mx.eval(step.h)
                outputs.extend([step.h] * (done - len(outputs)))
        if all_positions:
            return step.logits(all_positions=True), outputs
        return step.logits()[None], outputs


def reference_for(src: Path, bits: int | None) -> Reference:
    """The mlx-lm model matching `tiny_pair(..., bits)`: quantized in memory for 8 bits."""
    if (src, bits) not in _REFERENCES:
        _REFERENCES[(src, bits)] = Reference(src, quantize=8 if bits == 8 else None)
    return _REFERENCES[(src, bits)]


class Reference:
    """mlx-lm's model over the same source checkpoint, every expert resident."""

    def __init__(self, src: Path, quantize: int | None = None) -> None:
        from mlx_lm.utils import load_model, quantize_model

        self.model, self.config = load_model(Path(src))
        if quantize is not None:
            self.model, self.config = quantize_model(
                self.model, self.config, group_size=64, bits=quantize
            )
        self.text = self.model.language_model if "language_model" in self.model else self.model
        self.decoder = self.text.model

    def make_cache(self) -> list[Any]:
        return self.model.make_cache()

    def head(self, h: mx.array) -> mx.array:
        if self.text.args.tie_word_embeddings:
            return self.decoder.embed_tokens.as_linear(h)
        return self.text.lm_head(h)

    def forward(
        self, tokens: Sequence[int], cache: list[Any], *, layer_outputs: bool = False,
        all_positions: bool = True,
    ) -> tuple[mx.array, list[mx.array]]:
        """As mlx-lm's Qwen3NextModel.__call__, keeping each layer's output; logits as
        `DirectForward.forward`'s."""
        d = self.decoder
        h = d.embed_tokens(mx.array([list(tokens)]))
        fa_mask = create_attention_mask(h, cache[d.fa_idx])
        ssm_mask = create_ssm_mask(h, cache[d.ssm_idx])
        outputs: list[mx.array] = []
        for layer, c in zip(d.layers, cache, strict=True):
            h = layer(h, mask=ssm_mask if layer.is_linear else fa_mask, cache=c)
            if layer_outputs:
                mx.eval(h)
                outputs.append(h)
        logits = self.head(d.norm(h if all_positions else h[:, -1:]))[0]
        mx.eval(logits)
        return logits, outputs

    def logits(self, tokens: Sequence[int], cache: list[Any]) -> mx.array:
        """mlx-lm's own `model(inputs, cache)`, for the last position."""
        out = self.model(mx.array([list(tokens)]), cache=cache)[0, -1]
        mx.eval(out)
        return out


def greedy_reference(
    ref: Reference, prompt: Sequence[int], max_tokens: int, eos: set[int], chunk: int
) -> list[int]:
    """mlx-lm's model, prefilled in chunks of `chunk`, decoded by argmax; stops at EOS."""
    cache = ref.make_cache()
    logits = None
    for i in range(0, len(prompt), chunk):
        logits = ref.logits(prompt[i : i + chunk], cache)
    assert logits is not None
    out: list[int] = []
    while len(out) < max_tokens:
        token = int(mx.argmax(logits.astype(mx.float32)).item())
        out.append(token)
        if token in eos:
            break
        logits = ref.logits([token], cache)
    return out


def max_abs(a: mx.array, b: mx.array) -> float:
    assert a.shape == b.shape, f"shape {a.shape} != {b.shape}"
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item())

