"""A fast direct `.qpack` writer for benchmarks: real dimensions, random 4-bit experts.

Going through `synth` (an HF checkpoint) and `pack` costs hours and twice the disk for
the full-size presets, and the expert values do not matter for speed. This writes the
container directly:

- dense.safetensors: the same tensors (names, shapes, quantization, router init with
  its skew and cross-layer correlation) that `synth --bits 4` would write, through
  synth's own tensor writer, so the dense core behaves exactly like a packed one;
- experts: per layer one random base blob; expert e is the base with its packed 4-bit
  words XORed by a per-expert random key (still uniformly random nibbles, cheap, and
  every expert's bytes and crc32 differ). Per-group scales/biases make the dequantized
  weights zero-mean with std ~ 1/sqrt(fan_in) (down_proj also 1/sqrt(2 * layers), as
  synth's init); nibbles 0..15 are uniform, so mean 7.5 and std sqrt(255/12);
- tokenizer files from qpack.tokenizer, config.json as synth --bits 4 writes it, and
  the manifest (qpack.spec) with every file's sha256 and every expert's crc32, so the
  reader opens it and `moestream verify` passes.

Layer files are written by a thread pool (numpy XOR, crc32, sha256 and write all drop
the GIL); each thread holds one base blob and one output blob: flat RSS.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import structlog

from qpack import spec
from qpack.families import family as family_of
from qpack.output_guard import removed_on_failure, require_free_space
from qpack.quantize import Rule, quantized_shapes
from qpack.synth.checkpoint import WeightWriter
from qpack.synth.dims import ModelDims
from qpack.synth.init_weights import Init, WeightSource, f32_to_bf16_bits, rng_for
from qpack.synth.presets import get_preset, hf_config
from qpack.synth.st_write import TensorEntry, write_safetensors
from qpack.synth.tensor_inits import dense_inits

log = structlog.get_logger("qpack.synth.bench_container")
NIBBLE_MEAN = 7.5
NIBBLE_STD = math.sqrt((16 * 16 - 1) / 12)  # discrete uniform on 0..15
KEY_WORDS = 64  # uint64 words of a per-expert XOR key (512 bytes)


@dataclass
class BenchContainerResult:
    path: Path
    manifest: spec.Manifest
    bytes_written: int
    seconds: float
    dense_seconds: float
    experts_seconds: float

    @property
    def mb_s(self) -> float:
        return self.bytes_written / 1e6 / max(self.seconds, 1e-9)

    @property
    def experts_mb_s(self) -> float:
        return self.manifest.expert_bytes / 1e6 / max(self.experts_seconds, 1e-9)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _moe_layers(dims: ModelDims) -> list[int]:
    """The layers with routed experts (GLM's first layers are dense)."""
    return [layer for layer in range(dims.num_hidden_layers) if dims.is_moe(layer)]


def dense_entries(dims: ModelDims, bits: int, group_size: int, seed: int) -> tuple[list[TensorEntry], dict]:
    """Every non-expert tensor as `synth --bits` writes it, and the quantization overrides."""
    src = WeightSource(seed, dims.num_experts, dims.hidden_size)
    writer = WeightWriter(dims, "bfloat16", "hub", bits, group_size, src)
    h, v = dims.hidden_size, dims.vocab_size
    entries = writer.entries("embed_tokens.weight", Init("embed_tokens.weight", (v, h), "normal", 1.0))
    for layer in range(dims.num_hidden_layers):
        for rel, init in dense_inits(dims, layer):
            entries += writer.entries(rel, init)
    entries += writer.entries("norm.weight", writer.family.norm_init("norm.weight", h))
    entries += writer.entries("lm_head.weight", Init("lm_head.weight", (v, h), "normal", 1.0 / math.sqrt(h)))
    return entries, writer.overrides


def expert_layout(dims: ModelDims, bits: int, group_size: int) -> tuple[spec.ExpertFormat, int]:
    """The expert format `pack` plans for a bf16 source at `bits`, and its stride."""
    rule = Rule(bits, group_size)
    h, i = dims.hidden_size, dims.moe_intermediate_size
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for proj in spec.PROJECTIONS:
        q = quantized_shapes((h, i) if proj == "down_proj" else (i, h), rule)
        shapes[f"{proj}.weight"] = (q["weight"], "uint32")
        shapes[f"{proj}.scales"] = (q["scales"], "bfloat16")
        shapes[f"{proj}.biases"] = (q["biases"], "bfloat16")
        if family_of(dims.family).expert_biases:  # gpt-oss: each projection's own bias
            shapes[f"{proj}.bias"] = ((h if proj == "down_proj" else i,), "bfloat16")
    fmt = spec.expert_format(shapes, bits, group_size, "affine")
    return fmt, spec.round_up(fmt.nbytes, spec.ALIGNMENT)


def _template(dims: ModelDims, fmt: spec.ExpertFormat, stride: int, layer: int, seed: int) -> np.ndarray:
    """A layer's base blob: random packed words, per-group scales/biases, zero padding."""
    rng = rng_for(seed, f"bench.experts.{layer}")
    blob = np.zeros(stride, dtype=np.uint8)
    res = 1.0 / math.sqrt(2 * dims.num_hidden_layers)
    for proj in spec.PROJECTIONS:
        w = fmt.tensor(f"{proj}.weight")
        blob[w.offset : w.offset + w.nbytes] = np.frombuffer(rng.bytes(w.nbytes), dtype=np.uint8)
        s, b = fmt.tensor(f"{proj}.scales"), fmt.tensor(f"{proj}.biases")
        fan_in = s.shape[-1] * (fmt.group_size or 64)
        std = (res if proj == "down_proj" else 1.0) / math.sqrt(fan_in)
        # Groups differ a little (log-normal), as trained weights' group ranges do.
        scales = (std / NIBBLE_STD) * np.exp(rng.normal(0.0, 0.1, size=s.shape)).astype(np.float32)
        biases = -NIBBLE_MEAN * scales
        blob[s.offset : s.offset + s.nbytes] = f32_to_bf16_bits(scales).view(np.uint8).reshape(-1)
        blob[b.offset : b.offset + b.nbytes] = f32_to_bf16_bits(biases).view(np.uint8).reshape(-1)
        if f"{proj}.bias" in {t.name for t in fmt.tensors}:  # shared by the layer's experts
            t = fmt.tensor(f"{proj}.bias")
            bias = rng.normal(0.0, 0.02, size=t.shape).astype(np.float32)
            blob[t.offset : t.offset + t.nbytes] = f32_to_bf16_bits(bias).view(np.uint8).reshape(-1)
    return blob


def _write_layer(root: Path, dims: ModelDims, fmt: spec.ExpertFormat, stride: int, layer: int,
                 seed: int) -> tuple[str, int, str, list[int]]:
    rel = spec.layer_file(layer)
    path = root / rel
    partial = path.with_name(path.name + ".partial")
    base = _template(dims, fmt, stride, layer, seed)
    out = base.copy()
    regions = [fmt.tensor(f"{p}.weight") for p in spec.PROJECTIONS]
    keys = np.frombuffer(rng_for(seed, f"bench.keys.{layer}").bytes(8 * KEY_WORDS * dims.num_experts),
                         dtype=np.uint64).reshape(dims.num_experts, KEY_WORDS)
    sha = hashlib.sha256()
    crcs: list[int] = []
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for e in range(dims.num_experts):
            for t in regions:
                src = base[t.offset : t.offset + t.nbytes]
                dst = out[t.offset : t.offset + t.nbytes]
                if t.nbytes % (8 * KEY_WORDS) == 0:
                    np.bitwise_xor(src.view(np.uint64).reshape(-1, KEY_WORDS), keys[e],
                                   out=dst.view(np.uint64).reshape(-1, KEY_WORDS))
                else:  # tiny shapes: tile the key over the region
                    key = np.resize(keys[e].view(np.uint8), t.nbytes)
                    np.bitwise_xor(src, key, out=dst)
            view = memoryview(out)
            crcs.append(zlib.crc32(view[: fmt.nbytes]))
            sha.update(view)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    os.replace(partial, path)
    return rel, stride * dims.num_experts, sha.hexdigest(), crcs


def write_bench_container(
    out: str | os.PathLike[str],
    family: str | None,
    preset: str,
    *,
    bits: int = 4,
    group_size: int = 64,
    seed: int = 0,
    max_layers: int | None = None,
    workers: int | None = None,
    mtp: bool = False,
) -> BenchContainerResult:
    """Write a benchmark container for `family`/`preset` into the directory `out`;
    `mtp`: with the MTP head (qpack/mtp.py), as `pack` keeps it."""
    if bits not in (4, 8):
        raise ValueError(f"bits {bits!r}: the bench container writer makes 4- or 8-bit experts")
    dims = get_preset(family, preset)
    if max_layers is not None:
        if not 0 < max_layers <= dims.num_hidden_layers:
            raise ValueError(f"max_layers {max_layers}: expected 1..{dims.num_hidden_layers}")
        dims = msgspec.structs.replace(dims, num_hidden_layers=max_layers)
    root = Path(out)
    if (root / spec.MANIFEST).exists() or (root.exists() and any(root.iterdir())):
        raise spec.QpackError(root, "output directory exists and is not empty")
    entries, overrides = dense_entries(dims, bits, group_size, seed)
    fmt, stride = expert_layout(dims, bits, group_size)
    need = sum(e.nbytes for e in entries) + len(_moe_layers(dims)) * dims.num_experts * stride
    require_free_space(root, need, f"bench-container {dims.name}")
    with removed_on_failure(root):  # a failed write leaves no directory a re-run refuses
        return _write(root, dims, bits, group_size, seed, entries, overrides, fmt, stride, workers,
                      mtp)


def write_mtp_head(root: Path, dims: ModelDims, bits: int, seed: int,
                   files: dict[str, tuple[int, str]]) -> spec.LayerEntry:
    """The MTP head as `pack` makes it of synth's hub MTP tensors (8-bit): `mtp.safetensors`
    and its experts' blobs, added to `files`; the manifest's `mtp_experts` entry."""
    import mlx.core as mx

    from qpack.mtp import (
        MTP_FILE,
        blob_checksum,
        expert_blobs,
        expert_layout,
        mtp_arrays,
        split_experts,
    )
    from qpack.synth.mtp import mtp_entries

    src = WeightSource(seed, dims.num_experts, dims.hidden_size)
    read = {}
    for e in mtp_entries(src, dims, "float32"):
        read[e.name] = mx.array(np.concatenate(list(e.chunks()), axis=0).reshape(e.shape)).astype(mx.bfloat16)
    dense, experts = split_experts(mtp_arrays(read, dims.num_experts, bits))
    mx.save_safetensors(str(root / MTP_FILE), dense)
    files[MTP_FILE] = ((root / MTP_FILE).stat().st_size, _sha256_file(root / MTP_FILE))
    fmt, stride = expert_layout(experts)
    crcs = []
    with open(root / spec.MTP_EXPERTS_FILE, "wb") as f:
        for blob in expert_blobs(experts, fmt, stride):
            crcs.append(blob_checksum(blob, fmt))
            f.write(blob)
    path = root / spec.MTP_EXPERTS_FILE
    files[spec.MTP_EXPERTS_FILE] = (path.stat().st_size, _sha256_file(path))
    return spec.LayerEntry(dims.num_hidden_layers, spec.MTP_EXPERTS_FILE, dims.num_experts, stride,
                           fmt, tuple(crcs))


def _write(root: Path, dims: ModelDims, bits: int, group_size: int, seed: int,
           entries: list[TensorEntry], overrides: dict[str, Any], fmt: spec.ExpertFormat,
           stride: int, workers: int | None, mtp: bool = False) -> BenchContainerResult:
    (root / spec.EXPERTS_DIR).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    files: dict[str, tuple[int, str]] = {}

    config = hf_config(dims, "bfloat16", "hub")
    quant: dict[str, object] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    quant.update(dict(sorted(overrides.items())))
    config.pop("vision_config", None)
    config["quantization"] = quant
    config["quantization_config"] = quant
    (root / spec.CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    from qpack.synth.tokenizer import write_tokenizer
    from qpack.synth.variants import check_variant

    # The preset's release's tokenizer and chat (Kimi-K2's on its deepseek_v3 preset).
    small = [root / spec.CONFIG, *write_tokenizer(root, dims.family, check_variant(dims.family, None, dims.name))]
    for p in small:
        files[p.name] = (p.stat().st_size, _sha256_file(p))
    dense_size = write_safetensors(root / spec.DENSE, entries, {"format": "mlx"})
    files[spec.DENSE] = (dense_size, _sha256_file(root / spec.DENSE))
    mtp_experts = write_mtp_head(root, dims, bits, seed, files) if mtp else None
    t_dense = time.perf_counter()
    log.info("bench_container.dense", mb=round(dense_size / 1e6, 1), seconds=round(t_dense - t0, 2))

    moe = _moe_layers(dims)
    threads = workers or min(16, os.cpu_count() or 2, len(moe))
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(lambda layer: _write_layer(root, dims, fmt, stride, layer, seed), moe))
    t_experts = time.perf_counter()
    layers = []
    for layer, (rel, size, sha, crcs) in zip(moe, results, strict=True):
        files[rel] = (size, sha)
        layers.append(spec.LayerEntry(layer, rel, dims.num_experts, stride, fmt, tuple(crcs)))
    manifest = spec.Manifest(
        magic=spec.MAGIC, version=spec.VERSION, source=f"bench:{dims.family}/{dims.name}",
        model_type=dims.family, num_layers=dims.num_hidden_layers, num_experts=dims.num_experts,
        top_k=dims.num_experts_per_tok,
        quantization=spec.Quantization(bits, group_size, "affine",
                                       {k: dict(v) for k, v in sorted(overrides.items())}),
        alignment=spec.ALIGNMENT, checksum="crc32", dense_bytes=dense_size, layers=tuple(layers),
        files=tuple(spec.FileEntry(rel, size, sha) for rel, (size, sha) in sorted(files.items())),
        created_by="moestream bench-container", mtp_layers=1 if mtp else 0, mtp_experts=mtp_experts,
    )
    data = json.dumps(json.loads(spec.encode_manifest(manifest)), indent=2, sort_keys=True).encode() + b"\n"
    tmp = root / (spec.MANIFEST + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, root / spec.MANIFEST)
    seconds = time.perf_counter() - t0
    written = sum(size for size, _ in files.values())
    result = BenchContainerResult(root, manifest, written, seconds, t_dense - t0, t_experts - t_dense)
    log.info("bench_container.done", path=str(root), gb=round(written / 1e9, 2), seconds=round(seconds, 1),
             mb_s=round(result.mb_s, 1), experts_mb_s=round(result.experts_mb_s, 1), threads=threads)
    return result


def estimated_sizes(family: str | None, preset: str, bits: int = 4, group_size: int = 64) -> tuple[int, int]:
    """(bytes `synthesize` writes in bf16, bytes `pack --bits <bits>` makes of it), without
    writing or generating anything: what `run` needs free before its first step."""
    from qpack.synth.checkpoint import checkpoint_entries
    from qpack.synth.init_weights import WeightSource

    dims = get_preset(family, preset)
    writer = WeightWriter(dims, "bfloat16", "hub", None, group_size, WeightSource(0, dims.num_experts, dims.hidden_size))
    synth = sum(e.nbytes for e in checkpoint_entries(writer, dims))
    entries, _ = dense_entries(dims, bits, group_size, 0)
    _, stride = expert_layout(dims, bits, group_size)
    packed = sum(e.nbytes for e in entries) + len(_moe_layers(dims)) * dims.num_experts * stride
    if family_of(dims.family).mtp_head:
        from qpack.mtp import packed_bytes
        from qpack.synth.mtp import mtp_entries

        src = WeightSource(0, dims.num_experts, dims.hidden_size)
        packed += sum(packed_bytes(e.shape, 2, bits) for e in mtp_entries(src, dims, "bfloat16"))
    return synth, packed
