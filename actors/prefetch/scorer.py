"""How good the predictions were: precision, recall and the bytes wrong ones would read."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class PrefetchStats(msgspec.Struct):
    predicted: int = 0  # predicted (token, layer, expert) triples, unique per (token, layer)
    correct: int = 0  # predicted and then actually chosen
    actual: int = 0  # chosen (token, layer, expert) triples, predicted or not
    precision: float = 0.0
    recall: float = 0.0
    bytes_wasted: int = 0  # wrong predictions x expert stride: the reads they would cost
    stall_saved_s: float = 0.0  # filled in by the live engine from measured waits


class PrefetchScorer:
    """Scores predictions per (token, layer) when that layer's true routing arrives.

    Several predictions for one layer (lookahead predicts it from several earlier layers)
    are scored as their union: that union is what the prefetcher would have read.
    """

    def __init__(self, stride: int) -> None:
        self.stride = stride
        self._pending: dict[int, set[int]] = {}
        self._predicted = self._correct = self._actual = 0

    def begin_token(self) -> None:
        # Predictions for layers the token never reached are wrong predictions too.
        for ids in self._pending.values():
            self._predicted += len(ids)
        self._pending.clear()

    def record(self, predictions: Sequence[tuple[int, Sequence[int]]]) -> None:
        for layer, ids in predictions:
            self._pending.setdefault(int(layer), set()).update(int(e) for e in ids)

    def score(self, layer: int, actual: Sequence[int]) -> tuple[int, int]:
        """Score `layer` against its true routing; returns (predicted, correct) for it."""
        predicted = self._pending.pop(layer, set())
        correct = len(predicted.intersection(int(e) for e in actual))
        self._predicted += len(predicted)
        self._correct += correct
        self._actual += len(set(actual))
        return len(predicted), correct

    def stats(self) -> PrefetchStats:
        p, c, a = self._predicted, self._correct, self._actual
        return PrefetchStats(
            predicted=p,
            correct=c,
            actual=a,
            precision=c / p if p else 0.0,
            recall=c / a if a else 0.0,
            bytes_wasted=(p - c) * self.stride,
        )
