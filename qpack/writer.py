"""The packer: source checkpoint (local or hub) -> `.qpack` container, resumably.

Every file is written as `<name>.partial`, fsynced, then renamed; a small journal
(`.qpack-journal.json`, tmp+rename) records each finished file with its size, sha256
and per-expert crc32s. A run killed at any point (kill -9 included) leaves only whole
files plus at most one `.partial`; the next run skips what the journal lists and
redoes the rest. The output bytes depend only on the source and the options, so a
resumed container is byte-identical to an uninterrupted one. manifest.json is written
last: until it exists the reader refuses the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import msgspec
import structlog

from qpack import spec
from qpack.layout import ContainerPlan, LayerPlan, make_plan
from qpack.mtp import (
    MTP_FILE,
    blob_checksum,
    expert_blobs,
    expert_layout,
    mtp_arrays,
    mtp_bytes,
    mtp_names,
    split_experts,
)
from qpack.output_guard import bytes_under, exclusive_output, require_free_space
from qpack.pack_files import Done, _fsync_dir, _guard, _milestone, _Out, _pwrite
from qpack.pack_rerun import finished_differs
from qpack.quantize import MODE_DEFAULTS, cast, quantize
from qpack.safetensors_io import data_offsets, mx_to_bytes
from qpack.source import SourceCheckpoint, open_source
from qpack.spec import QpackError
from qpack.tokenizer_convert import tokenizer_outputs

log = structlog.get_logger("qpack.pack")
DENSE_CHUNK = 32 * 1024 * 1024  # bytes of source rows converted at once


class Journal(msgspec.Struct):
    options: dict[str, str | int | None]
    done: dict[str, Done] = {}
    mtp_format: spec.ExpertFormat | None = None  # the MTP head's experts, once written


@dataclass
class PackResult:
    manifest: spec.Manifest
    path: Path
    bytes_written: int
    seconds: float

    @property
    def mb_s(self) -> float:
        return self.bytes_written / 1e6 / max(self.seconds, 1e-9)


class Packer:
    def __init__(self, src: SourceCheckpoint, plan: ContainerPlan, out: Path, source_name: str,
                 options: dict, progress: bool, tokenizer: dict[str, bytes]) -> None:
        self.src, self.plan, self.out = src, plan, out
        self.tokenizer = tokenizer  # file name -> bytes (tokenizer_convert.tokenizer_outputs)
        self.source_name = source_name
        self.options = options
        self.progress = progress
        self.journal = self._load_journal()
        self.bytes_written = 0

    # -- journal ------------------------------------------------------------
    def _load_journal(self) -> Journal:
        path = self.out / spec.JOURNAL
        if path.exists():
            try:
                journal = msgspec.json.decode(path.read_bytes(), type=Journal)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("pack.journal_unreadable", path=str(path))
                return Journal(self.options)
            if journal.options != self.options:
                diff = {k: (journal.options.get(k), v) for k, v in self.options.items() if journal.options.get(k) != v}
                raise QpackError(self.out, f"a pack with other options is in progress here {diff}; "
                                 "re-run with the same options or use another -o")
            return journal
        if self.out.exists() and any(p.name != spec.JOURNAL + ".tmp" for p in self.out.iterdir()):
            raise QpackError(self.out, "output directory exists, is not empty and is not a partial container")
        # The journal goes first, so that whatever a kill leaves behind is a resumable pack.
        self.out.mkdir(parents=True, exist_ok=True)
        journal = Journal(self.options)
        self._save(journal, "start")
        return journal

    def _save(self, journal: Journal, step: str) -> None:
        tmp = self.out / (spec.JOURNAL + ".tmp")
        data = msgspec.json.encode(journal)
        try:
            _guard(tmp, lambda: tmp.write_bytes(data))
        except QpackError:  # disk full: leave the last whole journal, not a torn copy
            tmp.unlink(missing_ok=True)
            raise
        _milestone(f"journal-tmp {step}")
        os.replace(tmp, self.out / spec.JOURNAL)
        _milestone(f"journal {step}")

    def _commit(self, rel: str, done: Done) -> None:
        self.journal.done[rel] = done
        self._save(self.journal, rel)

    def _finished(self, rel: str) -> bool:
        d = self.journal.done.get(rel)
        path = self.out / rel
        return d is not None and path.is_file() and path.stat().st_size == d.size

    # -- steps ----------------------------------------------------------------
    def run(self, bar: Callable[[int], None]) -> spec.Manifest:
        self.out.mkdir(parents=True, exist_ok=True)
        for p in self.out.rglob("*.partial"):  # leftovers of a killed run
            p.unlink()
        self._small(spec.CONFIG, (json.dumps(self.plan.config, indent=2, sort_keys=True) + "\n").encode())
        for name, data in self.tokenizer.items():
            self._small(name, data)
        self._dense(bar)
        for layer in self.plan.layers:
            self._layer(layer, bar)
        self._mtp(bar)
        return self._manifest()

    def _mtp(self, bar: Callable[[int], None]) -> None:
        """The MTP head, when the source has one mlx-lm conventions can hold (qpack/mtp.py):
        its routed experts as a layer's blobs, the rest in `mtp.safetensors`."""
        names = mtp_names(self.src.index)
        if not names or self.src.is_mlx or self.src.fp8 is not None:
            return
        if self._finished(MTP_FILE) and self._finished(spec.MTP_EXPERTS_FILE):
            return
        if not all(self.src.index[n].is_file() for n in names):
            # Hub downloads skip shards that hold only MTP tensors (qpack.names): no head then.
            log.info("pack.mtp_skipped", reason="its shards were not downloaded")
            return
        default = self.plan.quant.default
        arrays = mtp_arrays({n: self.src.raw(n).to_mx() for n in names}, self.src.num_experts,
                            default.bits if default is not None else None)
        dense, experts = split_experts(arrays)
        if not self._finished(spec.MTP_EXPERTS_FILE):
            fmt, stride = expert_layout(experts)
            crcs: list[int] = []
            with _Out(self.out, spec.MTP_EXPERTS_FILE) as o:
                for blob in expert_blobs(experts, fmt, stride):
                    crcs.append(blob_checksum(blob, fmt))
                    o.write(blob)
                    bar(stride)
            self.bytes_written += o.size
            done = o.done()
            done.checksums = crcs
            self.journal.mtp_format = fmt
            self._commit(spec.MTP_EXPERTS_FILE, done)
        if self._finished(MTP_FILE):
            return
        partial = self.out / "mtp.partial.safetensors"
        _guard(partial, lambda: mx.save_safetensors(str(partial), dense))
        data = partial.read_bytes()
        os.replace(partial, self.out / MTP_FILE)
        _fsync_dir(self.out)
        self.bytes_written += len(data)
        bar(len(data))
        self._commit(MTP_FILE, Done(len(data), hashlib.sha256(data).hexdigest()))

    def _small(self, rel: str, data: bytes) -> None:
        if self._finished(rel):
            return
        with _Out(self.out, rel) as o:
            o.write(data)
        self._commit(rel, o.done())

    def _dense(self, bar: Callable[[int], None]) -> None:
        """dense.safetensors, written in row chunks at their planned offsets: affine groups
        never cross rows, so a chunk quantizes exactly like the whole tensor, and the
        largest tensor (the embedding) never has to be in memory at once."""
        if self._finished(spec.DENSE):
            bar(self.journal.done[spec.DENSE].size)
            return
        header, offsets, size = data_offsets(self.plan.dense_plan())
        path = self.out / spec.DENSE
        partial = path.with_name(path.name + ".partial")
        fd = _guard(partial, lambda: os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        try:
            _milestone(f"begin {spec.DENSE}")
            _pwrite(fd, header, 0, partial)
            for i, item in enumerate(self.plan.dense):
                info = self.src.info(item.ref.source)
                rows = (item.outputs[0].shape[0] if item.ref.part else info.shape[0]) if info.shape else 1
                # A part cut from a source tensor is computed whole (its rows are not the source's).
                step = rows if item.ref.part else max(1, DENSE_CHUNK // max(info.row_bytes(), 1))
                for start in range(0, rows, step):
                    stop = min(rows, start + step)
                    arr = cast(self.src.dense_tensor(item.ref, (start, stop) if info.shape else None), item.cast)
                    outs = quantize(arr, item.rule) if item.rule is not None else (arr,)
                    for t, a in zip(item.outputs, outs, strict=True):
                        row_bytes = t.nbytes // t.shape[0] if t.shape else t.nbytes
                        data = mx_to_bytes(a)
                        _pwrite(fd, data, offsets[t.name] + start * row_bytes, partial)
                        bar(len(data))
                _milestone(f"wrote {spec.DENSE} {i}")
            _guard(partial, lambda: os.fsync(fd))
        except QpackError:
            os.close(fd)
            partial.unlink(missing_ok=True)
            raise
        os.close(fd)
        sha = hashlib.sha256()
        with open(partial, "rb") as f:
            while chunk := f.read(1 << 22):
                sha.update(chunk)
        os.replace(partial, path)
        _fsync_dir(path.parent)
        _milestone(f"renamed {spec.DENSE}")
        self.bytes_written += size
        self._commit(spec.DENSE, Done(size, sha.hexdigest()))

    def _layer(self, lp: LayerPlan, bar: Callable[[int], None]) -> None:
        rel = spec.layer_file(lp.index)
        n = self.src.num_experts
        if self._finished(rel):
            bar(lp.stride * n)
            return
        crcs: list[int] = []
        with _Out(self.out, rel) as o:
            for e in range(n):
                blob = self._expert_blob(lp, e)
                crcs.append(zlib.crc32(memoryview(blob)[: lp.format.nbytes]))
                o.write(blob)
                bar(lp.stride)
                _milestone(f"wrote {rel} {e}")
        self.bytes_written += o.size
        done = o.done()
        done.checksums = crcs
        self._commit(rel, done)
        log.debug("pack.layer", layer=lp.index, bytes=o.size)

    def _expert_blob(self, lp: LayerPlan, e: int) -> bytearray:
        raw = self.src.expert(lp.index, e)
        parts: dict[str, bytes | bytearray | memoryview] = {}
        if self.plan.copy_quantized:
            parts = {k: t.data for k, t in raw.items()}
        else:
            for proj in spec.PROJECTIONS:
                w = cast(raw[f"{proj}.weight"].to_mx(), lp.cast)
                rule = lp.rules.get(proj, lp.rule)
                if rule is None:
                    parts[f"{proj}.weight"] = mx_to_bytes(w)
                    continue
                for part, arr in zip(("weight", "scales", "biases"), quantize(w, rule), strict=False):
                    parts[f"{proj}.{part}"] = mx_to_bytes(arr)
            for proj in spec.PROJECTIONS:  # gpt-oss: each expert's additive bias, float
                if f"{proj}.bias" in raw:
                    parts[f"{proj}.bias"] = mx_to_bytes(cast(raw[f"{proj}.bias"].to_mx(), lp.cast))
        blob = bytearray(lp.stride)
        for t in lp.format.tensors:
            data = parts[t.name]
            if len(data) != t.nbytes:
                raise QpackError(self.src.root, f"layer {lp.index} expert {e} {t.name}: {len(data)} bytes, format says {t.nbytes}")
            blob[t.offset : t.offset + t.nbytes] = data
        return blob

    def _manifest(self) -> spec.Manifest:
        done = self.journal.done
        q = self.plan.quant
        quant = spec.Quantization(
            q.default.bits if q.default else None,
            q.default.group_size if q.default else None,
            q.default.mode if q.default else None,
            {k: dict(v) for k, v in sorted(q.overrides.items())},
        )
        layers = tuple(
            spec.LayerEntry(lp.index, spec.layer_file(lp.index), self.src.num_experts, lp.stride, lp.format,
                            tuple(done[spec.layer_file(lp.index)].checksums))
            for lp in self.plan.layers
        )
        files = tuple(spec.FileEntry(rel, d.size, d.sha256) for rel, d in sorted(done.items()))
        mtp_experts = None
        fmt = self.journal.mtp_format
        if MTP_FILE in done and fmt is not None:
            blobs = done[spec.MTP_EXPERTS_FILE]
            mtp_experts = spec.LayerEntry(self.src.num_layers, spec.MTP_EXPERTS_FILE, self.src.num_experts,
                                          blobs.size // self.src.num_experts, fmt, tuple(blobs.checksums))
        manifest = spec.Manifest(
            magic=spec.MAGIC, version=spec.VERSION, source=self.source_name,
            model_type=self.src.model_type, num_layers=self.src.num_layers,
            num_experts=self.src.num_experts, top_k=self.src.top_k, quantization=quant,
            alignment=spec.ALIGNMENT, checksum="crc32", dense_bytes=done[spec.DENSE].size,
            layers=layers, files=files, mtp_layers=1 if MTP_FILE in done else 0, mtp_experts=mtp_experts,
        )
        data = json.dumps(json.loads(spec.encode_manifest(manifest)), indent=2, sort_keys=True).encode() + b"\n"
        with _Out(self.out, spec.MANIFEST) as o:
            o.write(data)
        (self.out / spec.JOURNAL).unlink(missing_ok=True)
        return manifest


def pack(source: str | os.PathLike[str], out: str | os.PathLike[str], *, bits: int | None = None,
         group_size: int | None = None, dtype: str | None = None, revision: str | None = None,
         progress: bool = True, mode: str = "affine") -> PackResult:
    """Pack `source` (a checkpoint dir or a hub repo id) into the container `out`.

    bits: quantize a float source at that many bits in MLX quantization `mode` (affine,
    mxfp4, nvfp4, mxfp8), 16 keeps it float, None means the mode's default (4) for a float
    source and "as it is" for an MLX-quantized one (copied, never re-quantized).
    group_size None: the mode's default (64 affine, 32 mxfp4/mxfp8, 16 nvfp4)."""
    from qpack.hub import resolve_source

    out = Path(out)
    if bits not in (None, 2, 3, 4, 5, 6, 8, 16):
        raise QpackError("--bits", f"{bits} is not one of 2, 3, 4, 5, 6, 8, 16")
    if mode not in MODE_DEFAULTS:
        raise QpackError("--mode", f"quantization mode {mode!r} is not one of {', '.join(MODE_DEFAULTS)}")
    group_size = group_size or MODE_DEFAULTS[mode][1]
    options = {"source": str(source), "bits": bits, "group_size": group_size, "dtype": dtype, "revision": revision}
    if mode != "affine":  # absent for affine, so journals of earlier packs still match
        options["mode"] = mode
    with exclusive_output(out, "pack"):
        if (out / spec.MANIFEST).exists():
            manifest = spec.decode_manifest((out / spec.MANIFEST).read_bytes(), out / spec.MANIFEST)
            differ = finished_differs(manifest, str(source), bits, group_size, mode)
            if differ:  # a re-run with other options must not get the old container
                raise QpackError(out, f"a finished container of other options is here {differ}; "
                                 "use another -o, or remove it to pack again")
            (out / spec.JOURNAL).unlink(missing_ok=True)
            log.info("pack.already_complete", path=str(out))
            return PackResult(manifest, out, 0, 0.0)
        t0 = time.perf_counter()
        resolved = resolve_source(str(source), revision=revision, progress=progress)
        if not Path(str(source)).is_dir():  # a hub repo: its files are one commit's (the
            # snapshot's name), so a resume after an upstream change starts no mixed container
            options["commit"] = resolved.name
        src = open_source(resolved)
        try:
            if src.quantization is not None and bits == 16:
                raise QpackError(src.root, "source is MLX-quantized; --bits 16 would need dequantizing, which pack does not do")
            default_bits = None if src.quantization is not None else MODE_DEFAULTS[mode][0]
            plan_bits = None if bits == 16 else (bits or default_bits)
            plan = make_plan(src, plan_bits, group_size, dtype, mode)
            total = sum(t.nbytes for t in plan.dense_plan()) + sum(lp.stride * src.num_experts for lp in plan.layers)
            total += mtp_bytes(src, plan)
            # Copied as they are, or converted once here (Kimi-K2's tiktoken.model) so that
            # a damaged file is refused before any weight is written.
            tokenizer = tokenizer_outputs(src.root, src.tokenizer_files(), _vocab_size(src))
            small = sum(len(data) for data in tokenizer.values())
            require_free_space(out, total + small, "packing", already=bytes_under(out))
            packer = Packer(src, plan, out, str(source), options, progress, tokenizer)
            manifest = _with_progress(packer, total, progress, out)
        finally:
            src.close()
    result = PackResult(manifest, out, packer.bytes_written, time.perf_counter() - t0)
    log.info("pack.done", path=str(out), mb=round(result.bytes_written / 1e6, 2), seconds=round(result.seconds, 2),
             mb_s=round(result.mb_s, 1))
    return result


def _vocab_size(src: SourceCheckpoint) -> int | None:
    """config.json's vocab_size (the embedding's rows), None where it gives none."""
    value = src.text.get("vocab_size")
    return value if isinstance(value, int) else None


def _with_progress(packer: Packer, total: int, progress: bool, out: Path) -> spec.Manifest:
    if not progress:
        return packer.run(lambda n: None)
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress("[bold]pack", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()) as p:
        task = p.add_task(out.name, total=total)
        return packer.run(lambda n: p.advance(task, n))
