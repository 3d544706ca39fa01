"""The `[sampling]` and `[chat]` config sections: only what the file says, nothing filled in.

A key left out of `[sampling]` falls back to the model's own `generation_config.json`
(Qwen's recommended temperature / top-p / top-k), then to the OpenAI defaults; so the
section keeps "unset" apart from "set to the API default" (None here), and `params()`
resolves it over whatever base the caller has.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from actors.sampling_params import SCALAR_KNOBS, SamplingParams

# The knobs a model's generation_config.json may also set: None here = not said.
OPTIONAL_KNOBS = SCALAR_KNOBS


# The bounds SamplingParams (shared with HTTP requests) leaves to its callers; the
# others (temperature in [0, 2], ...) are its own checks, run by __post_init__ below.
_TokenId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]  # and < vocab: Generation.check
_Many = msgspec.Meta(max_length=1024)


class SamplingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    stop: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=1024)], ...],
                    msgspec.Meta(max_length=16)] = ()
    stop_token_ids: Annotated[tuple[_TokenId, ...], _Many] = ()
    logit_bias: Annotated[tuple[tuple[_TokenId, float], ...], _Many] = ()  # (token id, bias) pairs
    logprobs: int | None = None  # the chosen token's and this many alternatives'

    def __post_init__(self) -> None:
        self.params()  # the range checks (and their messages) are SamplingParams'

    def explicit(self) -> dict[str, Any]:
        """The keys this section sets."""
        return {f: v for f in self.__struct_fields__
                if (v := getattr(self, f)) is not None and v != ()}

    def params(self, base: SamplingParams | None = None) -> SamplingParams:
        """These settings over `base` (the model's defaults; the API's when None)."""
        return msgspec.structs.replace(base or SamplingParams(), **self.explicit())


class ChatConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # The chat template's thinking switch (Qwen3.5/3.6, Qwen3 hybrids): false renders an
    # empty <think></think> so the model answers at once. None: the template's default.
    # A request's `chat_template_kwargs.enable_thinking` overrides it.
    enable_thinking: bool | None = None
