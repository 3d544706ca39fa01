"""Prefix checkpoints on disk: the prefix cache's states kept across restarts and evictions.

Agents resend the same long system prompt and tools on every call; a restart (or an
entry the memory budget evicted) would pay the whole prefill again. `DiskPrefixCache`
is the in-memory `PrefixCache` plus a bounded directory of its states: every kept state
of at least `min_tokens` tokens is also written to `dir` (by a writer thread, so the MLX
thread only copies the arrays out), and a lookup that finds a longer matching prefix on
disk than in memory loads it.

One file per state (`<fingerprint>-<hash of the tokens>.mspc`):

    magic "MSPC" | u32 format version | u64 header length | u32 crc32 of the header
    header (msgspec JSON: fingerprint, tokens, each layer's cache kind and arrays,
            the payload's length and crc32) | payload (the arrays' bytes)

written to a temporary name, fsynced and renamed, so a reader sees a whole file or none.
The fingerprint names the container and the code (pipeline.fingerprint); a file from
another container or version, a damaged one (short, wrong magic, a crc that does not
match, a layout other than the model's caches) is ignored with a log line, never
loaded. Past `max_bytes` the least recently used files go, whatever their fingerprint.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import os
import struct
import threading
import weakref
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec
import numpy as np
import structlog

from pipeline.models.kv_quant import is_quantized, kv_parts, set_kv_parts
from pipeline.prefix_cache import PrefixCache

log = structlog.get_logger("moestream.prefix_cache")

MAGIC = b"MSPC"
FORMAT_VERSION = 1
SUFFIX = ".mspc"
_PREFIX = struct.Struct("<4sIQI")  # magic, version, header length, header crc32
_MAX_HEADER = 64 << 20  # a header this long is damage, not a prompt
_PENDING = 2  # states waiting for the writer; a newer one pushes out the oldest
# Dtypes a state may hold, by name; stored as unsigned integers of the same width.
_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32,
           "uint32": mx.uint32}  # a quantized KV cache's packed data
_RAW = {2: (mx.uint16, np.uint16), 4: (mx.uint32, np.uint32)}


class ArrayRef(msgspec.Struct, frozen=True):
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class LayerState(msgspec.Struct, frozen=True):
    # "kv" (mlx-lm KVCache), "qkv" (QuantizedKVCache: keys' data, scales, biases, then the
    # values') or "arrays" (ArraysCache: DeltaNet conv + state)
    kind: str
    offset: int = 0  # a KV cache's filled length
    arrays: tuple[ArrayRef | None, ...] = ()
    # A ring's (RotatingKVCache: gpt-oss's sliding layers) next write position, `_idx`: its
    # buffer is stored as it lies (oldest entry wherever the ring wrapped), so reloaded it
    # continues bit for bit. -1: not a ring.
    wrap: int = -1
    bits: int = 0  # a quantized cache's bits and group size (its file is only for the same)
    group_size: int = 0


class Header(msgspec.Struct, frozen=True):
    fingerprint: str
    tokens: tuple[int, ...]
    layers: tuple[LayerState, ...]
    payload_bytes: int
    payload_crc32: int


class Damaged(ValueError):
    """A state file that must not be loaded (the message says why)."""


def encode_state(fingerprint: str, tokens: Sequence[int], cache: list[Any]) -> list[bytes]:
    """The file's bytes for `cache` after `tokens` (on the MLX thread: reads the arrays)."""
    chunks: list[bytes] = []
    size = 0

    def ref(a: mx.array | None) -> ArrayRef | None:
        nonlocal size
        if a is None:
            return None
        name = str(a.dtype).rsplit(".", 1)[-1]
        if name not in _DTYPES:
            raise TypeError(f"cannot store a {name} array")
        raw = np.array(a.view(_RAW[a.dtype.size][0])).tobytes()
        chunks.append(raw)
        size += len(raw)
        return ArrayRef(name, tuple(a.shape), size - len(raw), len(raw))

    layers = []
    for c in cache:
        if is_quantized(c):
            arrays = tuple(ref(a) for a in kv_parts(c, filled=True))
            layers.append(LayerState("qkv", int(c.offset), arrays, bits=int(c.bits),
                                     group_size=int(c.group_size)))
        elif hasattr(c, "offset") and hasattr(c, "keys"):
            arrays = tuple(ref(a) for a in kv_parts(c, filled=True))
            ring = hasattr(c, "max_size")
            layers.append(LayerState("kv", int(c.offset), arrays, int(c._idx) if ring else -1))
        elif isinstance(getattr(c, "cache", None), list):
            layers.append(LayerState("arrays", 0, tuple(ref(a) for a in c.cache)))
        else:
            raise TypeError(f"cannot store a {type(c).__name__}")
    crc = 0
    for chunk in chunks:
        crc = zlib.crc32(chunk, crc)
    header = msgspec.json.encode(Header(fingerprint, tuple(tokens), tuple(layers), size, crc))
    return [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), zlib.crc32(header)), header, *chunks]


def read_header(path: Path) -> tuple[Header, int]:
    """The file's header and where its payload starts; `Damaged` if it is not one of ours."""
    with open(path, "rb") as f:
        head = f.read(_PREFIX.size)
        if len(head) < _PREFIX.size:
            raise Damaged("shorter than its header")
        magic, version, length, crc = _PREFIX.unpack(head)
        if magic != MAGIC:
            raise Damaged("not a prefix state file")
        if version != FORMAT_VERSION:
            raise Damaged(f"format version {version}, this code reads {FORMAT_VERSION}")
        if length > _MAX_HEADER:
            raise Damaged(f"header of {length} bytes")
        raw = f.read(length)
    if len(raw) < length or zlib.crc32(raw) != crc:
        raise Damaged("header checksum mismatch")
    try:
        return msgspec.json.decode(raw, type=Header), _PREFIX.size + length
    except msgspec.DecodeError as exc:
        raise Damaged(f"header: {exc}") from None


def load_state(path: Path, header: Header, start: int, fresh: list[Any]) -> list[Any]:
    """`fresh` (the model's empty caches) filled from the file (on the MLX thread)."""
    with open(path, "rb") as f:
        f.seek(start)
        payload = f.read(header.payload_bytes + 1)
    if len(payload) != header.payload_bytes or zlib.crc32(payload) != header.payload_crc32:
        raise Damaged("payload checksum mismatch")
    if len(fresh) != len(header.layers):
        raise Damaged(f"{len(header.layers)} layer states for a model of {len(fresh)}")

    def array(ref: ArrayRef | None) -> mx.array | None:
        if ref is None:
            return None
        dtype = _DTYPES.get(ref.dtype)
        count = int(np.prod(ref.shape))
        if dtype is None or ref.offset + ref.nbytes > len(payload) or \
                count * dtype.size != ref.nbytes:
            raise Damaged(f"array {ref} does not fit the payload")
        raw = np.frombuffer(payload, _RAW[dtype.size][1], count, ref.offset)
        return mx.array(raw.reshape(ref.shape)).view(dtype)

    for i, (c, state) in enumerate(zip(fresh, header.layers, strict=True)):
        if state.kind == "qkv" and is_quantized(c):
            if (state.bits, state.group_size) != (c.bits, c.group_size):
                raise Damaged(f"layer {i}: a {state.bits}-bit KV state (groups of "
                              f"{state.group_size}) for a {c.bits}-bit cache (of {c.group_size})")
            if state.arrays:
                parts = [a for a in map(array, state.arrays) if a is not None]
                if len(parts) != 6:
                    raise Damaged(f"layer {i}: a quantized KV state with an array missing")
                set_kv_parts(c, parts)
            c.offset = state.offset
        elif state.kind == "kv" and hasattr(c, "offset") and hasattr(c, "keys") \
                and not is_quantized(c):
            if (state.wrap >= 0) != hasattr(c, "max_size"):
                raise Damaged(f"layer {i}: a {'ring' if state.wrap >= 0 else 'KV'} state for a {type(c).__name__}")
            if state.wrap >= 0:
                keys = state.arrays[0] if state.arrays else None
                held = keys.shape[2] if keys is not None and len(keys.shape) == 4 else 0
                if state.wrap > held:  # a write past the buffer: not a state we wrote
                    raise Damaged(f"layer {i}: a ring wrapping at {state.wrap} of {held} positions")
                c._idx = state.wrap
            if state.arrays:
                if len(state.arrays) != 2:
                    raise Damaged(f"layer {i}: a KV state needs keys and values")
                c.keys, c.values = (array(a) for a in state.arrays)
            c.offset = state.offset
        elif state.kind == "arrays" and isinstance(getattr(c, "cache", None), list) \
                and len(c.cache) == len(state.arrays):
            c.cache = [array(a) for a in state.arrays]
        else:
            raise Damaged(f"layer {i}: a {state.kind} state for a {type(c).__name__}")
    mx.eval([a for c in fresh for a in (
        kv_parts(c) if hasattr(c, "keys") else c.cache) if a is not None])
    return fresh


class DiskPrefixCache(PrefixCache):
    """`PrefixCache` whose states also live in `dir` (see the module docstring)."""

    def __init__(self, dir: Path, fingerprint: str, make_cache: Callable[[], list[Any]], *,
                 max_bytes: int, min_tokens: int, **memory: Any) -> None:
        super().__init__(**memory)
        self.dir = Path(dir)
        self.fingerprint = fingerprint
        self.make_cache = make_cache
        self.disk_max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # the index: read on the MLX thread, written by both
        self._index: dict[tuple[int, ...], Path] = {}
        self._pending: collections.deque[tuple[tuple[int, ...], list[bytes]]] = \
            collections.deque(maxlen=_PENDING)
        self._wake = threading.Condition()
        self._closed = False
        self._busy = False  # the writer holds a state it has not finished writing
        # A writer thread runs while states wait, and ends when none is left (so an
        # engine that closes leaves no thread behind).
        self._writer: threading.Thread | None = None
        self._scan()
        _OPEN.add(self)

    def _scan(self) -> None:
        for path in sorted(self.dir.glob(f"*{SUFFIX}")):
            try:
                header, _ = read_header(path)
            except (Damaged, OSError) as exc:
                log.warning("prefix_cache.disk_ignored", path=str(path), reason=str(exc))
                continue
            if header.fingerprint != self.fingerprint:
                log.info("prefix_cache.disk_stale", path=str(path),
                         fingerprint=header.fingerprint, ours=self.fingerprint)
                continue
            self._index[header.tokens] = path
        for tmp in self.dir.glob(f".*{SUFFIX}.*.tmp"):  # a write cut by a kill
            pid = tmp.name.rsplit(".", 2)[-2]
            if pid.isdigit() and not _alive(int(pid)):
                tmp.unlink(missing_ok=True)
        log.info("prefix_cache.disk_open", dir=str(self.dir), entries=len(self._index))

    def take(self, tokens: Sequence[int]) -> tuple[list[Any] | None, int]:
        # Memory's match is only measured here: copied where no longer file wins (it was
        # copied, and marked recently used, before a longer file replaced it).
        cached = self.longest(tokens)
        with self._lock:
            longer = [seq for seq in self._index
                      if cached < len(seq) < len(tokens) and tuple(tokens[: len(seq)]) == seq]
        for seq in sorted(longer, key=len, reverse=True):
            loaded = self._load(seq)
            if loaded is not None:
                PrefixCache.put(self, seq, loaded)  # already on disk: memory only
                return super().take(tokens)
        return super().take(tokens)

    def _load(self, seq: tuple[int, ...]) -> list[Any] | None:
        with self._lock:
            path = self._index.get(seq)
        if path is None:
            return None
        try:
            header, start = read_header(path)
            if header.tokens != seq or header.fingerprint != self.fingerprint:
                raise Damaged("header does not match the index")
            state = load_state(path, header, start, self.make_cache())
            os.utime(path)  # recently used: the budget removes others first
            log.info("prefix_cache.disk_loaded", tokens=len(seq), bytes=path.stat().st_size)
            return state
        except (Damaged, OSError) as exc:
            log.warning("prefix_cache.disk_ignored", path=str(path), reason=str(exc))
            with self._lock:
                self._index.pop(seq, None)
            return None

    def put(self, tokens: Sequence[int], cache: list[Any]) -> None:
        super().put(tokens, cache)
        key = tuple(tokens)
        with self._lock:
            known = key in self._index
        if len(key) < self.min_tokens or known or self._closed:
            return
        try:
            data = encode_state(self.fingerprint, key, cache)
        except TypeError as exc:
            log.debug("prefix_cache.disk_skipped", reason=str(exc))
            return
        if sum(map(len, data)) > self.disk_max_bytes:
            return
        with self._wake:
            self._pending.append((key, data))  # a full queue drops its oldest state
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="prefix-disk",
                                                daemon=True)
                self._writer.start()

    def _write_loop(self) -> None:
        while True:
            with self._wake:
                if not self._pending:
                    self._writer = None
                    self._wake.notify_all()
                    return
                key, data = self._pending.popleft()
                self._busy = True
            try:
                self._write(key, data)
            except OSError as exc:
                log.warning("prefix_cache.disk_write_failed", dir=str(self.dir), error=str(exc))
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _write(self, key: tuple[int, ...], data: list[bytes]) -> None:
        digest = hashlib.sha256(np.asarray(key, dtype=np.int64).tobytes()).hexdigest()[:24]
        path = self.dir / f"{self.fingerprint}-{digest}{SUFFIX}"
        tmp = self.dir / f".{path.name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            for chunk in data:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        with self._lock:
            self._index[key] = path
        log.debug("prefix_cache.disk_written", tokens=len(key), bytes=sum(map(len, data)))
        self._enforce_budget()

    def _enforce_budget(self) -> None:
        files = []
        for p in self.dir.glob(f"*{SUFFIX}"):
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if total <= self.disk_max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
            with self._lock:
                for seq in [s for s, q in self._index.items() if q == p]:
                    del self._index[seq]
            log.debug("prefix_cache.disk_evicted", path=str(p))

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until the states handed to the writer are on disk (or `timeout_s` passed)."""
        with self._wake:
            self._wake.wait_for(lambda: not self._pending and not self._busy, timeout_s)

    def close(self) -> None:
        """Write what is pending (at exit, at the latest); later states stay in memory."""
        self._closed = True
        self.flush()


# Open caches, for the exit hook: what a server that is stopping still has to write.
_OPEN: weakref.WeakSet[DiskPrefixCache] = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:
    for cache in list(_OPEN):
        cache.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prefix_cache_for(dir: str | None, root: Path, make_cache: Callable[[], list[Any]], *,
                     disk_mb: int, min_tokens: int, variant: str = "") -> PrefixCache:
    """The engine's prefix cache: in memory, plus on disk under `dir` when one is set.
    `variant`: what else a state depends on (the activations' dtype, a quantized KV cache);
    a file of another is stale (a CPU's float32 state is not a GPU's bfloat16 one)."""
    if not dir:
        return PrefixCache()
    from pipeline.fingerprint import fingerprint

    mark = fingerprint(root) + (f"-{variant}" if variant else "")
    return DiskPrefixCache(Path(dir).expanduser(), mark, make_cache,
                           max_bytes=disk_mb << 20, min_tokens=min_tokens)
