"""The sampling knobs are declared once (`SCALAR_KNOBS`); every place that carries them
has a field for each, so a new knob reaches the config, the model's generation config,
the OpenAI requests and Ollama's options, or this fails."""

from __future__ import annotations

import msgspec

from actors.sampling_params import SCALAR_KNOBS, SamplingParams
from pipeline.config.sampling import SamplingConfig
from pipeline.generation_config import GenerationConfig
from pipeline.server.routes_ollama import OLLAMA_NAMES, Options
from pipeline.server.schema import ChatRequest, CompletionRequest


def _fields(struct: type) -> set[str]:
    return {f.name for f in msgspec.structs.fields(struct)}


def test_every_knob_is_a_field_wherever_sampling_is_said() -> None:
    assert set(SCALAR_KNOBS) <= _fields(SamplingParams)
    for struct in (SamplingConfig, GenerationConfig, ChatRequest, CompletionRequest):
        assert set(SCALAR_KNOBS) <= _fields(struct), struct.__name__
    assert {OLLAMA_NAMES.get(k, k) for k in SCALAR_KNOBS} <= _fields(Options)


def test_a_config_and_a_generation_config_say_the_same_knobs_the_same_way() -> None:
    said = {k: 0.5 for k in SCALAR_KNOBS} | {"top_k": 7}
    assert SamplingConfig(**said).params() == SamplingParams(**GenerationConfig(**said).sampling())
