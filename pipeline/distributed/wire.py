"""What crosses between ranks, and the mlx.distributed calls that move it.

Per forward (a prefill chunk or a decode token) rank r sends rank r+1 a header (8 int32)
and the residual stream [1, tokens, hidden] as raw bits; the last rank sends rank 0 the
logits ([vocab], or [tokens, vocab] when every position's are wanted). Rank 0's commands
ride in the header, so every rank sees them in the same order: `FORWARD` (with the
sequence id whose caches to use: a new id starts a fresh sequence) and `SHUTDOWN`.

The functions taking numpy arrays run on the link thread (`link.Link`).
"""

from __future__ import annotations

from enum import IntEnum

import mlx.core as mx
import msgspec
import numpy as np

HEADER_SIZE = 8


class Command(IntEnum):
    FORWARD = 1
    SHUTDOWN = 2


# Activation dtypes by wire code, and the unsigned integer type that carries their bits.
DTYPES: tuple[mx.Dtype, ...] = (mx.float32, mx.bfloat16, mx.float16)
_BITS = {4: (mx.uint32, np.uint32), 2: (mx.uint16, np.uint16)}


class Header(msgspec.Struct, frozen=True):
    command: Command
    seq: int = 0
    tokens: int = 0
    all_positions: bool = False
    decode: bool = False  # phase: decode (else prefill); the prefetcher treats them apart
    dtype: int = 0  # index in DTYPES of the hidden state's dtype
    hidden: int = 0

    def encode(self) -> np.ndarray:
        row = [int(self.command), self.seq, self.tokens, int(self.all_positions),
               int(self.decode), self.dtype, self.hidden, 0]
        return np.array(row, dtype=np.int32)

    @classmethod
    def decode_from(cls, row: np.ndarray) -> Header:
        c, seq, tokens, every, decode, dtype, hidden, _ = (int(v) for v in row)
        return cls(Command(c), seq, tokens, bool(every), bool(decode), dtype, hidden)


def dtype_code(dtype: mx.Dtype) -> int:
    if dtype not in DTYPES:
        raise ValueError(f"activations of dtype {dtype} cannot cross between ranks")
    return DTYPES.index(dtype)


def to_bits(x: mx.array) -> np.ndarray:
    """On the MLX thread: `x`'s bits as a numpy array (evaluates `x`)."""
    return np.array(x.view(_BITS[x.dtype.size][0]), copy=True)


def from_bits(bits: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """On the MLX thread: the array whose bits `to_bits` gave."""
    return mx.array(bits).view(dtype)


def bits_dtype(dtype: mx.Dtype) -> type[np.unsignedinteger]:
    return _BITS[dtype.size][1]


# -- on the link thread ------------------------------------------------------------------


def send(bits: np.ndarray, dst: int) -> None:
    mx.eval(mx.distributed.send(mx.array(bits), dst, stream=mx.cpu))


def recv(shape: tuple[int, ...], dtype: type[np.generic], src: int) -> np.ndarray:
    like = mx.zeros(shape, dtype=mx.array(np.zeros((), dtype=dtype)).dtype, stream=mx.cpu)
    out = mx.distributed.recv_like(like, src, stream=mx.cpu)
    mx.eval(out)
    return np.array(out, copy=True)


def send_forward(header: Header, bits: np.ndarray, dst: int) -> None:
    send(header.encode(), dst)
    send(bits, dst)


def recv_header(src: int) -> Header:
    return Header.decode_from(recv((HEADER_SIZE,), np.int32, src))


def all_rows(row: np.ndarray, rank: int, size: int) -> np.ndarray:
    """Every rank's `row` (float64 [k]) as a [size, k] table, the same on every rank: an
    all_sum of a table where each rank filled only its own row (the ring has no gather
    for float64, and sums of one nonzero term are exact)."""
    table = np.zeros((size, row.shape[0]), dtype=np.float32)
    table[rank] = row
    out = mx.distributed.all_sum(mx.array(table), stream=mx.cpu)
    mx.eval(out)
    return np.array(out, copy=True).astype(np.float64)
