"""The MTP head in tests: a container as packed before its experts were streamed, and the
head's own expert pool driven outside an engine (the real reader, slot table and storage)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import mlx.core as mx
import msgspec
import trio

from actors.mlx_worker import MlxWorker
from actors.pool.eviction import make_policy
from actors.pool.head_pool import HeadPool
from actors.pool.layout import PoolLayout
from actors.pool.slots import SlotTable
from actors.pool.storage import PoolStorage
from actors.reader import ExpertReader
from pipeline.engine_parts import installer
from pipeline.models.mtp_experts import StreamedExperts
from pipeline.models.text_parts import TextParts
from qpack import spec
from qpack.mtp import MTP_FILE, mtp_arrays, mtp_names
from qpack.reader import Container


def _source_mtp(src: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for shard in sorted(src.glob("*.safetensors")):
        out.update({k: v for k, v in mx.load(str(shard)).items() if k.startswith("mtp.")})
    return out


def legacy_container(src: Path, container: Path, out: Path) -> Path:
    """`container` as the packer wrote it before the head's experts were streamed: the
    whole head (experts stacked in) in `mtp.safetensors`, made from the source as that
    packer made it (`mtp_arrays`, unsplit), and no `mtp_experts` in the manifest."""
    shutil.copytree(container, out)
    manifest = spec.decode_manifest((out / spec.MANIFEST).read_bytes(), out / spec.MANIFEST)
    bits = manifest.quantization.bits
    read = _source_mtp(src)
    assert sorted(read) == mtp_names(read)
    mx.save_safetensors(str(out / MTP_FILE), mtp_arrays(read, manifest.num_experts, bits))
    (out / spec.MTP_EXPERTS_FILE).unlink()
    data = (out / MTP_FILE).read_bytes()
    files = tuple(spec.FileEntry(f.path, len(data), hashlib.sha256(data).hexdigest())
                  if f.path == MTP_FILE else f
                  for f in manifest.files if f.path != spec.MTP_EXPERTS_FILE)
    old = msgspec.structs.replace(manifest, files=files, mtp_experts=None)
    raw = json.loads(spec.encode_manifest(old))
    del raw["mtp_experts"]  # an older manifest has no such key at all
    (out / spec.MANIFEST).write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return out


@asynccontextmanager
async def head_experts(container: Path, parts: TextParts, slots: int,
                       widen: str | None = "float32") -> AsyncIterator[StreamedExperts]:
    """The head's experts streamed from `container` into a pool of `slots`, through a
    running reader (as the engine wires them, without the model's router)."""
    c = Container.open(container)
    entry = c.manifest.mtp_experts
    assert entry is not None
    worker = MlxWorker.shared()
    storage = await worker.run(PoolStorage, PoolLayout.uniform(entry.format, widen), slots)
    reader = ExpertReader(c, concurrency=2, stride=entry.stride)

    async def no_router() -> None:  # nothing else holds the reader's buffers here
        return None

    pool = HeadPool(entry.index, entry.num_experts, SlotTable(slots, make_policy("lru")), reader,
                    installer(worker, storage), no_router)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            yield StreamedExperts(pool, storage, parts.family)
            nursery.cancel_scope.cancel()
    finally:
        c.close()
