"""The direct (DMA) install's byte ranges (actors/pool/direct_install.py): copying each
blob's tensors to the addresses they name fills the pool exactly as the CPU install does,
for a uniform pool and a mixed-precision one (per-layer formats in shared slots). On the
CPU the pool's memory is host memory, so `memmove` stands in for the GPU's DMA; the GPU
path itself is probed on the device before use (actors/cuda_direct.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from actors import cuda_direct
from actors.pool.direct_install import direct_copies, direct_ok
from actors.pool.layout import PoolLayout
from actors.pool.storage import PoolStorage
from qpack.reader import Container, aligned_empty


@pytest.mark.parametrize("recipe", [None, "mixed_3_6"])
def test_direct_copies_fill_the_slots_as_the_host_install_does(synth_checkpoint, packed, recipe) -> None:
    source = synth_checkpoint("qwen3_next", dtype="bfloat16", bits=None if recipe else 4, recipe=recipe)
    container = Container.open(packed(source))
    try:
        manifest = container.manifest
        layout = PoolLayout.of(manifest.layers)
        assert direct_ok(layout) and layout.mixed == (recipe is not None)
        # Every layer's expert 1 and 2, in scattered slots (the last one included).
        keys = [(e.index, x) for e in manifest.layers for x in (1, 2)]
        slots = list(range(len(keys) + 3))[::-1][: len(keys)]
        blobs = []
        for layer, expert in keys:
            buf = aligned_empty(manifest.max_stride)
            container.read_expert(layer, expert, buf)
            blobs.append(buf)
        items = list(zip(slots, blobs, strict=True))
        host, dma = (PoolStorage(layout, len(keys) + 3) for _ in range(2))
        for pool in (host, dma):
            pool.layer_of = dict(zip(slots, (layer for layer, _ in keys), strict=True)).get
        host.write(items)
        assert dma.host_bytes is not None
        base = {name: rows.ctypes.data for name, rows in dma.host_bytes.items()}
        for dst, src, n in direct_copies(layout, base, items, dma._layer_format):
            ctypes.memmove(dst, src, n)
        assert host.host_bytes is not None
        for name in layout.arrays:
            assert np.array_equal(host.host_bytes[name], dma.host_bytes[name]), name
        assert all(host.host_bytes[name][slots].any() for name in layout.arrays)
    finally:
        container.close()


def test_a_widened_pool_is_not_written_directly(synth_checkpoint, packed) -> None:
    """float32 activations keep bfloat16 scales widened in the pool: bytes cannot go as they are."""
    container = Container.open(packed(synth_checkpoint("qwen3_next", dtype="bfloat16", bits=4)))
    try:
        assert not direct_ok(PoolLayout.of(container.manifest.layers, widen="float32"))
        assert direct_ok(PoolLayout.of(container.manifest.layers))
    finally:
        container.close()
    # Off CUDA there is nothing to probe: the engine keeps its host install.
    assert cuda_direct.probe({}) is None


async def test_asking_for_direct_where_it_cannot_run_opens_with_the_host_install(synth_checkpoint, packed) -> None:
    """`reader.device_copy = "direct"` on MLX's CPU backend: the probe declines, the engine
    opens, installs by memcpy as always and says so; the tokens are those of the default."""
    from helpers_engine import engine_config, generate

    from pipeline.engine import open_engine

    container = packed(synth_checkpoint("qwen3_next", dtype="bfloat16", bits=4))
    tokens = []
    for copy in ("direct", "auto"):
        async with open_engine(engine_config(container, reader={"device_copy": copy})) as engine:
            assert engine.facts.device_copy == "host"
            tokens.append(list((await generate(engine, [4791, 11, 1879, 0], 6)).token_ids))
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6
