"""Drafts from the MTP head, fed with the main model's hidden states as they are computed.

Every forward of the sequence (prefill chunks, decode steps, verify passes) hands its
final residual stream to `sink` (StreamedModel.hidden_sink), kept by position; a later
forward over the same positions (a pass that kept fewer tokens, a redone step)
overwrites it. At each draft the head first catches up: one forward over the positions
i it has not seen whose next token t[i+1] is known (the prompt's, the tokens handed
out), which extends its own KV cache as the reference implementations do, and whose
last position predicts the first draft; each further draft feeds the head's output back
as the hidden state, and those speculative positions are cut from its cache again.
Drafts are argmax (q one-hot), so the row's sampler verifies them exactly.

Positions whose hidden state the drafter never saw (a prompt resumed from the prefix
cache, steps decoded in a batch) are skipped: the head's attention then sees fewer
positions, which may draft worse, never wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from pipeline.models.mtp import MtpHead
from pipeline.models.routing_override import positions
from pipeline.models.text_parts import TextParts


class MtpDrafter:
    on_mlx = True  # `propose` runs MLX work: the decoder calls it on the MLX thread

    def __init__(self, head: MtpHead, parts: TextParts, prompt: Sequence[int],
                 activation_dtype: mx.Dtype | None) -> None:
        self.head, self.parts, self.dtype = head, parts, activation_dtype
        self.tokens = list(prompt)
        self.cache = KVCache()
        self.done = 0  # positions i < done have been through the head
        self._hidden: dict[int, mx.array] = {}  # position -> normed h_i, [1, 1, H] (lazy)

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens += [int(t) for t in tokens]

    def sink(self, cache: list[Any], h: mx.array) -> None:
        """On the MLX thread, from each forward of this sequence: h [1, T, H], lazy."""
        end = positions(cache)[0]
        normed = self.parts.norm(h)
        start = end - h.shape[1]
        for i in range(h.shape[1]):
            if start + i >= self.done:
                self._hidden[start + i] = normed[:, i : i + 1]

    def _embed(self, ids: mx.array) -> mx.array:
        e = self.parts.embed_tokens(ids.reshape(1, -1))
        return e if self.dtype is None else e.astype(self.dtype)

    def propose(self, k: int) -> list[int]:
        """On the MLX thread: up to `k` drafts for the tokens after the last one."""
        if k < 1:
            return []
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
            return []
        hidden = mx.concatenate([self._hidden[i] for i in run], axis=1)
        out = self.head(self._embed(mx.array([self.tokens[i + 1] for i in run])), hidden, self.cache)
        self.done = last
        for i in [p for p in self._hidden if p < last]:
            del self._hidden[i]
        out = out[:, -1:]
        drafts = [mx.argmax(self.parts.head(out)[0, 0])]
        for _ in range(k - 1):
            out = self.head(self._embed(drafts[-1]), out, self.cache)
            drafts.append(mx.argmax(self.parts.head(out)[0, 0]))
        if k > 1:
            self.cache.trim(k - 1)  # speculative positions: redone with the true hidden states
        return cast(list[int], mx.stack(drafts).tolist())
