"""Drafts from the MTP head, fed with the main model's hidden states as they are computed.

Every forward of the sequence (prefill chunks, decode steps, verify passes) hands its
final residual stream to `sink` (StreamedModel.hidden_sink), kept by position; a later
forward over the same positions (a pass that kept fewer tokens, a redone step)
overwrites it. At each draft the head first catches up: one forward over the positions
i it has not seen whose next token t[i+1] is known (the prompt's, the tokens handed
out), which extends its own KV cache as the reference implementations do, and whose
last position predicts the first draft (only that position goes through the head's
experts: the others' outputs are never read, and a catch-up over a prompt read most of
the head's experts for them: 587 ms of a 31-token prompt on the project VM, session 28);
each further draft feeds the head's output back
as the hidden state, and those speculative positions are cut from its cache again.
Drafts are argmax (q one-hot), so the row's sampler verifies them exactly.

A catch-up's length is however many positions passed since the last draft (a prompt, or
the plain steps of an `auto` that drafts now and then), and MLX's CUDA backend compiles
kernels for each new length: a trial that caught up 40-odd positions stalled a 32-token
generation ~40 s on the H100 (session 34, `warm-spec-auto`'s second pair, twice). So a
catch-up goes through the head in pieces whose lengths are powers of two up to `PIECE`
(the attention alone for all but the last, which predicts): a handful of shapes, each
compiled once.

Positions whose hidden state the drafter never saw (a prompt resumed from the prefix
cache, steps decoded in a batch) are skipped: the head's attention then sees fewer
positions, which may draft worse, never wrong.

With its routed experts streamed (`experts`, pipeline/models/mtp_experts.py) each head
forward reads what it routes to between its MLX calls; held resident (a container packed
before they were streamed), the whole draft is one call on the MLX thread. The same ops
either way, so the same drafts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from pipeline.models.mtp import MtpHead
from pipeline.models.mtp_experts import StreamedExperts
from pipeline.models.text_parts import TextParts

PIECE = 32  # the longest catch-up piece (see the module's docstring)


def pieces(n: int) -> list[int]:
    """`n` positions as powers of two of at most `PIECE`, longest first."""
    out = [PIECE] * (n // PIECE)
    rest = n % PIECE
    out += [1 << b for b in range(rest.bit_length() - 1, -1, -1) if rest >> b & 1]
    return out


class MtpDrafter:
    def __init__(self, head: MtpHead, parts: TextParts, prompt: Sequence[int],
                 activation_dtype: mx.Dtype | None, experts: StreamedExperts | None = None) -> None:
        self.head, self.parts, self.dtype, self.experts = head, parts, activation_dtype, experts
        self.tokens = list(prompt)
        self.cache = KVCache()
        self.done = 0  # positions i < done have been through the head
        self._hidden: dict[int, mx.array] = {}  # position -> normed h_i, [1, 1, H] (lazy)

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens += [int(t) for t in tokens]

    def sink(self, end: int, h: mx.array) -> None:
        """On the MLX thread, from each forward this sequence is in (alone, or a row of a
        decode batch): h [1, T, H], lazy, for the positions before `end`."""
        normed = self.parts.norm(h)
        start = end - h.shape[1]
        for i in range(h.shape[1]):
            if start + i >= self.done:
                self._hidden[start + i] = normed[:, i : i + 1]

    def _embed(self, ids: mx.array) -> mx.array:
        e = self.parts.embed_tokens(ids.reshape(1, -1))
        return e if self.dtype is None else e.astype(self.dtype)

    def _catch_up(self) -> tuple[mx.array, mx.array] | None:
        """On the MLX thread: the first forward's inputs (embeddings of t[i+1], hidden
        states h_i over the positions not yet seen), or None when the last position's
        hidden state is missing (nothing to draft from)."""
        last = len(self.tokens) - 1  # its hidden state comes with the next forward
        if self.done > last:  # the sequence was cut back (a pass kept fewer tokens)
            self.cache.trim(self.done - last)
            self.done = last
        ready = [i for i in range(self.done, last) if i in self._hidden]
        # The newest contiguous run of positions that ends right before `last`.
        run: list[int] = []
        for i in reversed(ready):
            if run and i != run[-1] - 1:
                break
            run.append(i)
        run.reverse()
        if not run or run[-1] != last - 1:
            return None
        hidden = mx.concatenate([self._hidden[i] for i in run], axis=1)
        embeds = self._embed(mx.array([self.tokens[i + 1] for i in run]))
        self.done = last
        for i in [p for p in self._hidden if p < last]:
            del self._hidden[i]
        sizes, start = pieces(len(run)), 0
        for n in sizes[:-1]:  # their attention fills the head's KV cache (lazily)
            self.head.attend(embeds[:, start : start + n], hidden[:, start : start + n], self.cache, True)
            start += n
        return embeds[:, start:], hidden[:, start:]

    def _argmax(self, out: mx.array) -> mx.array:
        return mx.argmax(self.parts.head(out)[0, 0])

    def _end(self, drafts: list[mx.array], k: int) -> list[int]:
        if k > 1:
            self.cache.trim(k - 1)  # speculative positions: redone with the true hidden states
        return cast(list[int], mx.stack(drafts).tolist())

    def propose(self, k: int) -> list[int]:
        """On the MLX thread, the head's experts resident: up to `k` drafts for the
        tokens after the last one."""
        inputs = self._catch_up() if k >= 1 else None
        if inputs is None:
            return []
        out = self.head(*inputs, self.cache, last_only=True)
        drafts = [self._argmax(out)]
        for _ in range(k - 1):
            out = self.head(self._embed(drafts[-1]), out, self.cache)
            drafts.append(self._argmax(out))
        return self._end(drafts, k)

    async def draft(self, k: int, on_mlx: Callable[..., Awaitable[Any]]) -> list[int]:
        """`propose`, its MLX work run through `on_mlx`; with streamed experts, each head
        forward reads its experts between its MLX calls."""
        if self.experts is None:
            return cast(list[int], await on_mlx(self.propose, k))
        inputs = await on_mlx(self._catch_up) if k >= 1 else None
        if inputs is None:
            return []
        embeds, hidden = inputs
        out = await self.experts.forward(self.head, embeds, hidden, self.cache, on_mlx, last_only=True)
        drafts = [await on_mlx(self._argmax, out)]
        for _ in range(k - 1):
            embeds = await on_mlx(self._embed, drafts[-1])
            out = await self.experts.forward(self.head, embeds, out, self.cache, on_mlx)
            drafts.append(await on_mlx(self._argmax, out))
        return cast(list[int], await on_mlx(self._end, drafts, k))

