"""Make sure a config's container exists: pack it from `model.source` on first use.

`source = "synth:<preset>"` (or `"synth:<family>/<preset>"`) synthesizes that preset
next to the container first; anything else is a checkpoint directory or a hub repo
id handed to the packer. Both steps resume after an interruption.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from pipeline.config.schema import SYNTH_PREFIX, ModelConfig
from qpack import families
from qpack.spec import MANIFEST

log = structlog.get_logger("moestream.prepare")

DEFAULT_FAMILY = families.DEFAULT
SYNTH_DONE = ".synth-complete"


def parse_synth(source: str) -> tuple[str | None, str]:
    """`synth:demo` -> (None, "demo"); `synth:qwen3_5_moe/tiny` -> ("qwen3_5_moe", "tiny")."""
    family, _, preset = source.removeprefix(SYNTH_PREFIX).rpartition("/")
    return family or None, preset


def ensure_container(model: ModelConfig, *, bits: int = 4, progress: bool = True) -> Path:
    from qpack.output_guard import bytes_under, require_free_space
    from qpack.synth.bench_container import estimated_sizes
    from qpack.synth.checkpoint import synthesize
    from qpack.synth.presets import FULL_SIZE
    from qpack.writer import pack

    path = Path(model.path)
    if (path / MANIFEST).exists():
        return path
    if model.source is None:
        raise FileNotFoundError(
            f"model.path {str(path)!r} holds no finished container (no {MANIFEST}) and "
            "model.source is not set, so there is nothing to pack it from"
        )
    source = model.source
    if source.startswith(SYNTH_PREFIX):
        family, preset = parse_synth(source)
        if family is None and preset not in FULL_SIZE:
            family = DEFAULT_FAMILY
        src = path.with_name(path.name.removesuffix(".qpack") + "-source")
        if not (src / SYNTH_DONE).exists():
            # Both steps' room up front: finding the disk full after hours of synthesis is
            # what this avoids (the 80B preset writes 159 GB, then packs 45 GB more).
            synth_bytes, packed_bytes = estimated_sizes(family, preset, bits)
            require_free_space(path, synth_bytes + packed_bytes, f"synth {preset} + pack",
                               already=bytes_under(src, "model*.safetensors*") + bytes_under(path))
            log.info("prepare.synthesize", preset=preset, family=family, out=str(src))
            synthesize(src, family, preset, dtype="bfloat16", progress=progress)
            (src / SYNTH_DONE).touch()
        source = str(src)
    log.info("prepare.pack", source=source, out=str(path), bits=bits)
    pack(source, path, bits=bits, progress=progress)
    return path
