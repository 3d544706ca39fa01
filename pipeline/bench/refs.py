"""The references `moestream bench` compares against, and page-cache control.

- `resident_decode`: mlx-lm with the whole model resident (dense core + every expert
  stacked into `switch_mlp`, as `mlx_lm.utils.load_model` would hold it), decoded with
  mlx-lm's own `generate_step`: the compute ceiling for this model on this machine.
- `read_bandwidth`: random reads of one expert stride from the container's layer
  files, cold, with the reader's concurrency: what the disk gives the streamer. Times
  the bytes a decode token has to read, it is the I/O ceiling.
- `drop_page_cache`: POSIX_FADV_DONTNEED on every container file, so a run is cold.
"""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import msgspec
import numpy as np

from qpack import spec
from qpack.reader import Container, aligned_empty
from qpack.safetensors_io import load_safetensors

_NP = {"uint32": np.uint32, "uint8": np.uint8, "bfloat16": np.uint16, "float16": np.float16,
       "float32": np.float32}


def drop_page_cache(root: str | os.PathLike[str]) -> int:
    """Evict every file of the container from the page cache; returns the bytes covered."""
    total = 0
    for path in sorted(Path(root).rglob("*")):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


class Bandwidth(msgspec.Struct):
    reads: int
    bytes: int
    seconds: float
    threads: int
    o_direct: bool

    @property
    def gb_s(self) -> float:
        return self.bytes / 1e9 / max(self.seconds, 1e-9)


def read_bandwidth(root: str | os.PathLike[str], *, threads: int, o_direct: bool,
                   max_reads: int = 2000, max_bytes: int = 4 << 30, seed: int = 0,
                   cold: bool = True) -> Bandwidth:
    """Random reads of whole expert strides (each expert at most once); cold: from the
    disk, else from wherever the pages are (a warm page cache: a fast disk's stand-in)."""
    if cold:
        drop_page_cache(root)
    container = Container.open(root, verify="off", o_direct=o_direct)
    try:
        m = container.manifest
        keys = [(layer.index, e) for layer in m.layers for e in range(layer.num_experts)]
        random.Random(seed).shuffle(keys)
        n = max(1, min(len(keys), max_reads, max_bytes // max(m.max_stride, 1)))
        keys = keys[:n]
        buffers = [aligned_empty(m.max_stride) for _ in range(threads)]

        def work(i: int) -> int:
            done = 0
            for layer, e in keys[i::threads]:
                container.read_expert(layer, e, buffers[i])
                done += container.layer(layer).stride
            return done

        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            nbytes = sum(pool.map(work, range(threads)))
        seconds = time.perf_counter() - start
        return Bandwidth(n, nbytes, seconds, threads, container.o_direct)
    finally:
        container.close()


IO_DEPTHS = (1, 2, 4, 8, 16)


def best_bandwidth(root: str | os.PathLike[str], *, o_direct: bool, cold: bool = True,
                   depths: tuple[int, ...] = IO_DEPTHS,
                   max_bytes: int = 3 << 29) -> tuple[Bandwidth, dict[int, float]]:
    """`read_bandwidth` at each depth (another shuffle of the experts each time), the
    best and every depth's GB/s: the disk's bandwidth. Not the engine's start-up probe,
    whose few reads a depth are coarse by design: on the page cache its first depth once
    read what the process before had just read, from the CPU's cache, measured above the
    next and stopped there, so `io` read with one thread (7.4-7.9 GB/s, H200, sessions
    17-25) where eight read 47 (session 26)."""
    runs = {d: read_bandwidth(root, threads=d, o_direct=o_direct, max_bytes=max_bytes, seed=d, cold=cold)
            for d in depths}
    best = max(runs.values(), key=lambda bw: bw.gb_s)
    return best, {d: bw.gb_s for d, bw in runs.items()}


def _switch_prefix(model_type: str, layer: int) -> str:
    from qpack.families import family

    fam = family(model_type)
    return f"{fam.decoder_prefix}.layers.{layer}.mlp.{fam.routed_module}"


def stacked_experts(container: Container) -> dict[str, mx.array]:
    """Every layer's experts as mlx-lm's stacked switch_mlp tensors [E, ...]."""
    m = container.manifest
    out: dict[str, mx.array] = {}
    for entry in m.layers:
        raw = np.fromfile(container.root / entry.file, dtype=np.uint8).reshape(entry.num_experts, entry.stride)
        for t in entry.format.tensors:
            part = np.ascontiguousarray(raw[:, t.offset : t.offset + t.nbytes])
            arr = mx.array(part.view(_NP[t.dtype]).reshape(entry.num_experts, *t.shape))
            if t.dtype == "bfloat16":
                arr = arr.view(mx.bfloat16)
            mx.eval(arr)
            out[f"{_switch_prefix(m.model_type, entry.index)}.{t.name}"] = arr
        del raw
    return out


def load_resident(container: Container) -> nn.Module:
    """The full mlx-lm model with every expert resident, loaded as mlx_lm.utils.load_model does."""
    from pipeline.models import deltanet_kernel
    from qpack.mlx_model import model_classes

    deltanet_kernel.install()  # the streamer's recurrence, so the two compare like for like
    config = container.config
    weights = load_safetensors(container.dense_path)
    weights.update(stacked_experts(container))
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    quantization = config.get("quantization")
    if quantization is not None:
        def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
            if path in quantization:
                return quantization[path]
            return hasattr(module, "to_quantized") and f"{path}.scales" in weights

        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                    mode=quantization.get("mode", "affine"), class_predicate=predicate)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    _match_activation_dtype(model)
    return model


class _CastEmbedding(nn.Module):
    """The embedding, with its output cast to the activation dtype the streamer uses."""

    def __init__(self, inner: nn.Module, dtype: mx.Dtype) -> None:
        super().__init__()
        self.inner = inner
        self.dtype = dtype

    def __call__(self, x: mx.array) -> mx.array:
        return self.inner(x).astype(self.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.inner.as_linear(x)


def _match_activation_dtype(model: nn.Module) -> None:
    # Same rule as the streamer (compute.dtype = "auto"): float32 activations on MLX's CPU,
    # whose bfloat16 kernels are ~10x slower; otherwise the ceiling would not be one.
    from pipeline.models.streamed import activation_dtype

    dtype = activation_dtype("auto")
    if dtype is not None:
        text = model.language_model if "language_model" in model else model
        text.model.embed_tokens = _CastEmbedding(text.model.embed_tokens, dtype)


class ResidentResult(msgspec.Struct):
    decode_tok_s: float
    prefill_tok_s: float
    ttft_s: float
    tokens: int
    load_s: float
    peak_device_mb: float
    model_bytes: int


def resident_bytes(container: Container) -> int:
    return container.manifest.dense_bytes + sum(
        sum(t.nbytes for t in e.format.tensors) * e.num_experts for e in container.manifest.layers)


def resident_decode(root: str | os.PathLike[str], prompt: list[int], max_tokens: int,
                    seed: int = 0) -> ResidentResult:
    model, load_s, nbytes = resident_model(root)
    return decode_resident(model, prompt, max_tokens, seed, load_s, nbytes)


def resident_model(root: str | os.PathLike[str]) -> tuple[nn.Module, float, int]:
    """mlx-lm's model with every expert resident: (model, load seconds, its bytes)."""
    container = Container.open(root, verify="off")
    try:
        t0 = time.perf_counter()
        model = load_resident(container)
        return model, time.perf_counter() - t0, resident_bytes(container)
    finally:
        container.close()


def decode_resident(model: nn.Module, prompt: list[int], max_tokens: int, seed: int = 0,
                    load_s: float = 0.0, nbytes: int = 0) -> ResidentResult:
    """One generation of `model` with mlx-lm's own `generate_step`, after a warm-up."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    sampler = make_sampler(temp=1.0)
    # Warm-up: the first calls compile kernels; the ceiling is the steady state.
    for _ in generate_step(mx.array(prompt[:4]), model, max_tokens=2, sampler=sampler):
        pass
    mx.reset_peak_memory()
    start = time.perf_counter()
    first = None
    n = 0
    for _token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler):
        n += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    decode = (n - 1) / (end - first) if n > 1 else 0.0
    return ResidentResult(decode, len(prompt) / (first - start), first - start, n, load_s,
                          mx.get_peak_memory() / 2**20, nbytes)


def container_summary(root: str | os.PathLike[str]) -> dict[str, Any]:
    with Container.open(root, verify="off") as c:
        m = c.manifest
        return {
            "path": str(root), "model_type": m.model_type, "source": m.source,
            "layers": len(m.layers), "num_experts": m.num_experts, "top_k": m.top_k,
            "stride": m.max_stride, "dense_mb": m.dense_bytes / 2**20,
            "experts_mb": m.expert_bytes / 2**20, "bits": m.quantization.bits,
            "decode_bytes_all_miss": len(m.layers) * m.top_k * m.max_stride,
            "alignment": spec.ALIGNMENT,
        }
