"""A prompt's last chunk and its last token, stepped together layer by layer.

A prompt is read as chunks of all its tokens but the last, then the last token alone
(as mlx-lm does: the state before the last token is what prefix reuse keeps, and the
first logits come from a one-token forward). Run one after the other, the last token
finds none of its experts in the pool: the chunk read every layer's, and the later
layers' reads evicted the earlier ones. A cold token's reads at every layer (297 ms of a
1024-token prefill's 10.6 s on the H200, session 17; the whole of a short prompt's
second half).

Here the two forwards go through the layers in lockstep: at each MoE layer the chunk's
step runs to its routing, then (`between`: a prefix checkpoint of the layers the chunk
has finished, before the last token writes them) the last token's step runs to its own,
and the layer's demand is the union of both, read once. Each forward computes exactly
what it computes alone (the same ops on the same inputs, in the same order per layer:
the last token's mixer reads the caches after the chunk wrote them); only the order of
the reads changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import mlx.core as mx
import numpy as np

from actors.forward import ForwardStepper, Presync, Routing


class EndingStepper(ForwardStepper, Protocol):
    def end(self) -> None:
        """The forward's end without logits (its output and the caches evaluated)."""
        ...

    def sink(self, behind: int) -> None:
        """Hand its final hidden states on (an MTP drafter's), the caches `behind` ahead."""
        ...


class PairStep:
    """`first` (the chunk) then `second` (the last token), one routing per MoE layer.

    `between(upto)`: called after each of `first`'s steps, before `second`'s, once the
    caches of layers < `upto` hold everything `first` writes to them."""

    def __init__(self, first: EndingStepper, second: ForwardStepper,
                 between: Callable[[int | None], None]) -> None:
        self.first = first
        self.second = second
        self.between = between

    def run_to_routing(self, presync: Presync | None = None) -> Routing | None:
        a = self.first.run_to_routing(presync)
        self._first_done(a)
        return _merged(a, self.second.run_to_routing(presync))

    def advance(self, slot_of: np.ndarray, presync: Presync | None = None) -> Routing | None:
        a = self.first.advance(slot_of, presync)
        self._first_done(a)
        return _merged(a, self.second.advance(slot_of, presync))

    def _first_done(self, a: Routing | None) -> None:
        if a is None:
            self.first.end()
        # A pending layer's mixer has written its cache; the experts write none.
        self.between(None if a is None else a.layer + 1)

    def logits(self, all_positions: bool = False) -> mx.array:
        """The last token's; first, the chunk's hidden states go to the sink, as its own
        forward's end would have sent them (an MTP drafter takes them in order)."""
        assert not all_positions, "a pair gives the last token's logits only"
        self.first.sink(behind=1)
        return self.second.logits()


def _merged(a: Routing | None, b: Routing | None) -> Routing | None:
    """One routing for both: the chunk's positions, then the last token's."""
    if a is None or b is None:
        assert a is None and b is None, "paired steps go through the same layers"
        return None
    assert a.layer == b.layer, (a.layer, b.layer)
    return Routing(a.layer, np.concatenate([a.ids, b.ids]), mx.concatenate([a.hidden, b.hidden]))
