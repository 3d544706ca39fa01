"""What crosses between ranks, and the mlx.distributed calls that move it.

Per forward (a prefill chunk, a decode token, or a decode step of a batch of sequences)
rank r sends rank r+1 a header (9 int32), for a batch the rows' sequence ids (int32
[rows]), and the residual stream [rows, tokens, hidden] as raw bits; the last rank sends
rank 0 the logits ([1, vocab], [rows, vocab] for a batch, or [tokens, vocab] when every
position's are wanted). Rank 0's commands ride in the header, so every rank sees them in
the same order: `FORWARD` (with the sequence ids whose caches to use: a new id starts a
fresh sequence, a new list of ids regroups the batch), the prefix cache's commands
(header only, sent in front of a forward) and `SHUTDOWN`.

The functions taking numpy arrays run on the link thread (`link.Link`).
"""

from __future__ import annotations

from enum import IntEnum

import mlx.core as mx
import msgspec
import numpy as np

HEADER_SIZE = 9


class Command(IntEnum):
    FORWARD = 1
    SHUTDOWN = 2
    # The prefix cache's entries on the later ranks (pipeline/distributed/prefixes.py).
    KEEP = 3
    SNAPSHOT = 4
    RESTORE = 5
    DROP = 6


# Activation dtypes by wire code, and the unsigned integer type that carries their bits.
DTYPES: tuple[mx.Dtype, ...] = (mx.float32, mx.bfloat16, mx.float16)
_BITS: dict[int, tuple[mx.Dtype, type[np.unsignedinteger]]] = {
    4: (mx.uint32, np.uint32), 2: (mx.uint16, np.uint16)}


class Header(msgspec.Struct, frozen=True):
    command: Command
    seq: int = 0
    tokens: int = 0
    all_positions: bool = False
    decode: bool = False  # phase: decode (else prefill); the prefetcher treats them apart
    dtype: int = 0  # index in DTYPES of the hidden state's dtype
    hidden: int = 0
    rows: int = 1  # sequences in the forward: more than one, their ids follow the header
    key: int = 0  # a prefix cache entry (its commands)

    def encode(self) -> np.ndarray:
        row = [int(self.command), self.seq, self.tokens, int(self.all_positions),
               int(self.decode), self.dtype, self.hidden, self.rows, self.key]
        return np.array(row, dtype=np.int32)

    @classmethod
    def decode_from(cls, row: np.ndarray) -> Header:
        c, seq, tokens, every, decode, dtype, hidden, rows, key = (int(v) for v in row)
        return cls(Command(c), seq, tokens, bool(every), bool(decode), dtype, hidden, rows, key)


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


def send_forward(header: Header, seqs: list[int], bits: np.ndarray, dst: int) -> None:
    """A forward's header, its rows' sequence ids (a batch's only: one rides in the
    header) and its residual stream."""
    send(header.encode(), dst)
    if header.rows > 1:
        send(np.array(seqs, dtype=np.int32), dst)
    send(bits, dst)


def recv_header(src: int) -> Header:
    return Header.decode_from(recv((HEADER_SIZE,), np.int32, src))


def recv_forward(header: Header, src: int) -> tuple[list[int], np.ndarray]:
    """What follows a `FORWARD` header: the rows' sequence ids and the residual stream."""
    seqs = [header.seq]
    if header.rows > 1:
        seqs = [int(s) for s in recv((header.rows,), np.int32, src)]
    kind = bits_dtype(DTYPES[header.dtype])
    return seqs, recv((header.rows, header.tokens, header.hidden), kind, src)


def all_rows(row: np.ndarray, rank: int, size: int) -> np.ndarray:
    """Every rank's `row` (float64 [k]) as a [size, k] table, the same on every rank: an
    all_sum of a table where each rank filled only its own row (the ring has no gather
    for float64, and sums of one nonzero term are exact)."""
    table = np.zeros((size, row.shape[0]), dtype=np.float32)
    table[rank] = row
    out = mx.distributed.all_sum(mx.array(table), stream=mx.cpu)
    mx.eval(out)
    return np.array(out, copy=True).astype(np.float64)
