"""From sampled token ids to text a caller may see.

`StopMatcher` cuts the streamed text at the first stop string without ever emitting any
part of it, even when a stop string spans several token deltas. `TextStream` is the glue:
an mlx-lm streaming detokenizer (whole UTF-8 characters only) feeding a `StopMatcher`,
ending on EOS / stop ids / stop strings. The engine's sampler task runs exactly this.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Protocol


class StopMatcher:
    """Streams text while cutting it at the first stop string.

    `feed(delta)` returns `(text_to_emit, stopped)`. Text that might be the start of a
    stop string is held back until the next delta decides it; `flush()` releases what is
    held when generation ends for another reason (EOS, length). Once stopped, everything
    after the stop string is dropped.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(stops)
        for s in self.stops:
            if not s:
                raise ValueError("stop strings must not be empty")
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        buf = self._held + delta
        hit = self._first_match(buf)
        if hit is not None:
            index, stop = hit
            self.stopped, self.matched, self._held = True, stop, ""
            return buf[:index], True
        keep = self._holdback(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, for when generation ended without a stop string."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _holdback(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:n]):
                    longest = n
                    break
        return longest


FinishReason = Literal["stop", "length"]


class Detokenizer(Protocol):
    """What `TextStream` needs: mlx-lm's `StreamingDetokenizer` (`TokenizerWrapper.detokenizer`)."""

    def add_token(self, token: int) -> object: ...

    def finalize(self) -> object: ...

    @property
    def last_segment(self) -> str: ...


class TextStream:
    """Sampled token ids -> text deltas that are safe to send to a client.

    `add(token)` returns `(delta, finish_reason)`: finish_reason is "stop" when the token is
    an EOS / stop token (the token itself produces no text, as in the OpenAI API) or the
    text reached a stop string (cut before it), else None. `finish()` ends a stream that
    ran out of tokens ("length") and returns the text still held back. `text` is all that
    was emitted so far.
    """

    def __init__(
        self,
        detokenizer: Detokenizer,
        stops: Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
    ) -> None:
        self._detok = detokenizer
        self._matcher = StopMatcher(stops)
        self._stop_ids = frozenset(stop_token_ids)
        self.text = ""
        self.finish_reason: FinishReason | None = None

    def add(self, token: int) -> tuple[str, FinishReason | None]:
        if self.finish_reason is not None:
            return "", self.finish_reason
        if token in self._stop_ids:
            return self._end("stop"), "stop"
        self._detok.add_token(token)
        out, stopped = self._matcher.feed(self._detok.last_segment)
        self.text += out
        if stopped:
            self.finish_reason = "stop"
        return out, self.finish_reason

    def finish(self, reason: FinishReason = "length") -> str:
        """End the stream (no-op if it already ended); returns the last text to emit."""
        if self.finish_reason is not None:
            return ""
        return self._end(reason)

    def _end(self, reason: FinishReason) -> str:
        self.finish_reason = reason
        self._detok.finalize()
        out, stopped = self._matcher.feed(self._detok.last_segment)
        if not stopped:
            out += self._matcher.flush()
        self.text += out
        return out
