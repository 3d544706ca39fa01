"""Token ids from configs and callers are checked against the vocabulary before MLX sees
them: a `logit_bias` id at or past the vocabulary used to index out of bounds (heap
corruption, rc 134; a segfault for 99999999): `Generation.check` refuses them for every
caller (library, `generate`, the server), and `serve` refuses a config bias at start.
And `serve` applies the config's `[sampling] logit_bias` as `generate` does (a request's
own field replaces it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_server_errors import running_server

from actors.sampling_params import SamplingParams
from pipeline.config.errors import ConfigError
from pipeline.events import Done
from pipeline.server.app import serve_engine
from pipeline.server.settings import ServerSettings


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


def _vocab(container: Path) -> int:
    from qpack.reader import Container

    return int(Container.open(container, verify="off").config["vocab_size"])


async def _text(engine, params: SamplingParams) -> Done:
    async for event in engine.generate("Hi", params):
        if isinstance(event, Done):
            return event
    raise AssertionError("no Done")


async def test_ids_past_the_vocabulary_are_refused_and_serve_applies_the_config_bias(container: Path) -> None:
    vocab = _vocab(container)
    favoured = 1234
    defaults = SamplingParams(temperature=0.0, logit_bias=((favoured, 100.0),))
    # One engine for the library and the server cases (each open costs seconds).
    async with running_server(container, defaults=defaults) as (engine, http):
        for bad in (vocab, vocab + 64, 99_999_999):
            params = SamplingParams(temperature=0.0, max_tokens=2, logit_bias=((bad, 5.0),))
            with pytest.raises(ValueError, match=f"logit_bias token id {bad} is outside the "
                               f"vocabulary \\[0, {vocab}\\)"):
                engine.start("Hi", params)
            assert engine.waiting == 0  # refused before queueing
        last = SamplingParams(temperature=0.0, max_tokens=2, logit_bias=((vocab - 1, 100.0),))
        done = await _text(engine, last)
        assert done.token_ids == (vocab - 1, vocab - 1)  # the last id is a real one
        # The same refusal for a request is a 400 naming the field.
        refused = await http.post("/v1/completions", json={
            "prompt": "Hi", "max_tokens": 2, "logit_bias": {str(vocab): 1}})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias"
        # serve applies the config's bias to a request that sends none ...
        plain = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert plain.status_code == 200, plain.text
        assert plain.json()["choices"][0]["text"] == engine.tokenizer.decode([favoured, favoured])
        # ... and a request's own logit_bias replaces it.
        other = await http.post("/v1/completions", json={
            "prompt": "Hi", "max_tokens": 2, "logit_bias": {"4321": 100}})
        assert other.json()["choices"][0]["text"] == engine.tokenizer.decode([4321, 4321])
        # The server refuses, at start, a config bias the model cannot take.
        bad = SamplingParams(logit_bias=((vocab, 1.0),))
        with pytest.raises(ConfigError, match=f"sampling.logit_bias token id {vocab}"):
            await serve_engine(engine, ServerSettings(port=0, defaults=bad))
        assert (await http.get("/health")).status_code == 200
