"""generation_config.json: kept in the container, its eos ids end generations, its sampling
values apply where config and request are silent; the thinking switch per request, call
and config. On tiny synthetic checkpoints with the hub's files (Instruct and Thinking)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import openai
import pytest
from helpers_server import serving
from structlog.testing import capture_logs

from actors.sampling_params import SamplingParams
from pipeline.chat_template import TemplateKwargsError, template_kwargs
from pipeline.config.errors import ConfigError
from pipeline.config.loading import config_from_dict
from pipeline.config.sampling import ChatConfig, SamplingConfig
from pipeline.engine import open_engine
from pipeline.events import Done
from pipeline.generation_config import default_params, eos_token_ids, model_defaults
from qpack import spec
from qpack.families.qwen3_next import BOS, EOS
from qpack.spec import QpackError
from qpack.synth.presets import get_preset
from qpack.synth.tokenizer import TokenizerSpec
from qpack.synth.variants import generation_config

# The tiny Qwen3-Next's <|endoftext|> and <|im_end|>: its vocabulary's ids (`bpe_ranks`).
_TINY = TokenizerSpec("qwen3_next", ranks=get_preset("qwen3_next", "tiny").bpe_ranks)
QWEN3_NEXT_BOS, QWEN3_NEXT_EOS = _TINY.token_id(BOS), _TINY.token_id(EOS)

USER = [{"role": "user", "content": "Name three primes."}]


def _config(container: Path, **sections: dict) -> object:
    base = {"model": {"path": str(container)}, "pool": {"slots": 16},
            "compute": {"prefill_chunk": 4}, **sections}
    return config_from_dict(base)


def _with_generation_config(container: Path, tmp: Path, gen: dict) -> Path:
    """A copy of `container` (read-only, shared) with another generation_config.json."""
    out = tmp / "c.qpack"
    shutil.copytree(container, out)
    _replace_listed(out, "generation_config.json", json.dumps(gen).encode())
    return out


@pytest.fixture(scope="module")
def thinking(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next", dtype="bfloat16", variant="thinking"), bits=4)


def test_thinking_preset_files(synth_checkpoint) -> None:
    src = synth_checkpoint("qwen3_next", dtype="bfloat16", variant="thinking")
    gen = json.loads((src / "generation_config.json").read_text())
    assert (gen["temperature"], gen["top_p"], gen["top_k"]) == (0.6, 0.95, 20)
    assert gen["eos_token_id"] == [QWEN3_NEXT_EOS, QWEN3_NEXT_BOS]  # <|im_end|>, <|endoftext|>
    instruct = generation_config(get_preset("qwen3_next", "tiny"))
    assert (instruct["temperature"], instruct["top_p"], instruct["top_k"]) == (0.7, 0.8, 20)
    with pytest.raises(ValueError, match="variant 'thinking' does not exist for qwen3_5_moe"):
        generation_config(get_preset("qwen3_5_moe", "tiny"), "thinking")


async def test_kept_in_container_eos_and_sampling_defaults(thinking: Path) -> None:
    manifest = json.loads((thinking / spec.MANIFEST).read_text())
    assert "generation_config.json" in {f["path"] for f in manifest["files"]}
    assert eos_token_ids(thinking) == [QWEN3_NEXT_EOS, QWEN3_NEXT_BOS]
    # Config silent: the model's values; a config key wins over the model's for that key.
    cfg = _config(thinking, sampling={"top_k": 5})
    async with open_engine(cfg) as engine:
        assert set(engine.tokenizer.eos_token_ids) == {QWEN3_NEXT_EOS, QWEN3_NEXT_BOS}
        params = engine.default_params()
        assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 5)
        assert engine.default_params(max_tokens=3).max_tokens == 3
        # The same from the container and the config alone, without an engine.
        assert default_params(thinking, cfg.sampling) == params
        # The Thinking template opens <think> in the prompt.
        assert engine.tokenizer.decode(engine.chat_tokens(USER)).endswith("<think>\n")


async def test_generation_config_eos_ends_generation(synth_checkpoint, packed,
                                                     tmp_path: Path) -> None:
    """A token that greedy decoding emits, listed only in generation_config.json's
    eos_token_id, stops the generation there (finish "stop"). Each container is a copy of
    the shared 4-bit pack with its generation_config.json (and manifest entry) replaced:
    what packing a checkpoint carrying that file writes (the pack keeping the file is
    `test_kept_in_container_eos_and_sampling_defaults`)."""
    shared = packed(synth_checkpoint("qwen3_next", dtype="bfloat16"), bits=4)
    plain = _with_generation_config(shared, tmp_path / "a", {"eos_token_id": [QWEN3_NEXT_EOS]})
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    async with open_engine(_config(plain)) as engine:
        done = [e async for e in engine.chat(USER, greedy)][-1]
    assert isinstance(done, Done) and done.finish_reason == "length"
    second = done.token_ids[1]
    assert second not in done.token_ids[:1]
    stopping = _with_generation_config(shared, tmp_path / "b",
                                       {"eos_token_id": [QWEN3_NEXT_EOS, second]})
    async with open_engine(_config(stopping)) as engine:
        done2 = [e async for e in engine.chat(USER, greedy)][-1]
    assert done2.finish_reason == "stop" and done2.token_ids == done.token_ids[:2]


def test_precedence_and_bad_files(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "do_sample": True, "other": "ignored"}))
    model = model_defaults(tmp_path)
    assert (model.temperature, model.top_p, model.top_k) == (0.7, 0.8, 20)
    section = SamplingConfig(temperature=1.0, seed=3)  # set to the API default: still set
    params = section.params(model)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (1.0, 0.8, 20, 3)
    assert SamplingConfig().params() == SamplingParams()
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_k": 0}))
    assert model_defaults(tmp_path).temperature == 0.0 and model_defaults(tmp_path).top_k == 0
    # Odd values (as hub files carry them) are warned about and left unsaid, field by field.
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0, "top_k": 7}))
    with capture_logs() as logs:
        model = model_defaults(tmp_path)
    assert (model.top_p, model.top_k) == (SamplingParams().top_p, 7)
    assert [(e["event"], e["field"]) for e in logs] == [("generation_config.field_ignored", "top_p")]
    assert "top_p must be in (0, 1]" in logs[0]["reason"]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    assert eos_token_ids(tmp_path) is None  # nor does config.json say: the tokenizer's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, -1]}))
    with capture_logs() as logs:
        assert eos_token_ids(tmp_path) is None
    assert "eos_token_id -1 is negative" in logs[0]["reason"]
    # Not a JSON object at all: refused, as transformers refuses it.
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(QpackError, match="generation_config.json does not read: a JSON object"):
        model_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(QpackError, match="generation_config.json does not read"):
        model_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"top_k": ' + "[" * 100_000)
    with pytest.raises(QpackError, match="nested too deeply to be a valid generation_config.json"):
        model_defaults(tmp_path)
    with pytest.raises(ConfigError, match="sampling.temperature must be in"):
        config_from_dict({"model": {"path": str(tmp_path)}, "sampling": {"temperature": 3}})


def _replace_listed(container: Path, name: str, data: bytes) -> None:
    """`name` in `container` replaced by `data`, its manifest entry (size, sha256) with it:
    what a pack of a checkpoint carrying that file would have written."""
    (container / name).write_bytes(data)
    manifest = json.loads((container / spec.MANIFEST).read_text())
    entry = next(f for f in manifest["files"] if f["path"] == name)
    entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (container / spec.MANIFEST).write_text(json.dumps(manifest))


async def test_a_wrong_type_in_generation_config_is_warned_and_served(
        synth_checkpoint, packed, tmp_path: Path) -> None:
    """A container whose generation_config.json says `"temperature": "hot"` (and a top_k
    of the wrong type), as packed from such a hub checkpoint: `serve` starts, warns
    naming each field, and uses the config's default for it while keeping the file's
    other values."""
    odd = tmp_path / "odd.qpack"
    shutil.copytree(packed(synth_checkpoint("qwen3_next"), bits=None), odd)
    _replace_listed(odd, "generation_config.json", json.dumps(
        {"temperature": "hot", "top_p": 0.8, "top_k": "many", "eos_token_id": [QWEN3_NEXT_EOS]}).encode())
    with capture_logs() as logs:
        async with serving(odd) as (engine, port):
            params = engine.default_params()
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
            reply = await client.chat.completions.create(model="tiny", messages=USER,
                                                         max_tokens=1)
    api = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k) == (api.temperature, 0.8, api.top_k)
    assert reply.usage is not None and reply.usage.completion_tokens == 1
    ignored = {e["field"]: e for e in logs if e["event"] == "generation_config.field_ignored"}
    assert set(ignored) == {"temperature", "top_k"}, ignored
    assert ignored["temperature"]["value"] == "'hot'" and "float" in ignored["temperature"]["reason"]
    assert all(e["log_level"] == "warning" for e in ignored.values())


def test_template_kwargs_layers() -> None:
    assert template_kwargs(ChatConfig()) == {}
    assert template_kwargs(ChatConfig(enable_thinking=False)) == {"enable_thinking": False}
    assert template_kwargs(ChatConfig(enable_thinking=False), True) == {"enable_thinking": True}
    assert template_kwargs(ChatConfig(), True, {"enable_thinking": False, "x": 1}) == {
        "enable_thinking": False, "x": 1}
    with pytest.raises(TemplateKwargsError, match="chat_template_kwargs.tools: is an argument"):
        template_kwargs(ChatConfig(), None, {"tools": []})
    with pytest.raises(TemplateKwargsError, match="enable_thinking: must be true or false"):
        template_kwargs(ChatConfig(), None, {"enable_thinking": "no"})


@pytest.fixture(scope="module")
def hybrid(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_5_moe", dtype="bfloat16"), bits=4)


async def test_enable_thinking_per_request_call_and_config(hybrid: Path) -> None:
    """Qwen3.5/3.6: chat_template_kwargs.enable_thinking=false renders the empty think block,
    so the reply is content, not reasoning; the config's [chat] switch is the default."""
    async with serving(hybrid, {}) as (engine, port):
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                    max_retries=0)
        kw = {"model": "hybrid", "messages": USER, "max_tokens": 4, "temperature": 0.0}
        on = await client.chat.completions.create(**kw)
        off = await client.chat.completions.create(
            **kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert on.choices[0].message.content == ""
        assert on.choices[0].message.reasoning_content  # type: ignore[attr-defined]
        assert off.choices[0].message.content
        assert getattr(off.choices[0].message, "reasoning_content", None) is None
        # "<think>\n\n</think>\n\n" after the generation prompt's "<think>\n".
        assert off.usage.prompt_tokens > on.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="enable_thinking: must be true or false"):
            await client.chat.completions.create(
                **kw, extra_body={"chat_template_kwargs": {"enable_thinking": "no"}})
        # Fields a request leaves out take generation_config.json's (hybrid: 1.0 / 0.95 / 20).
        base = {"model": "hybrid", "messages": USER, "max_tokens": 5, "seed": 11}
        silent = await client.chat.completions.create(**base)
        same = await client.chat.completions.create(**base, temperature=1.0, top_p=0.95,
                                                    extra_body={"top_k": 20})
        api = await client.chat.completions.create(**base, temperature=1.0, top_p=1.0,
                                                   extra_body={"top_k": 0})
        texts = [m.choices[0].message.reasoning_content for m in (silent, same, api)]  # type: ignore[attr-defined]
        assert texts[0] == texts[1] != texts[2]
        # The library call's switch.
        text = engine.tokenizer.decode(engine.chat_tokens(USER, enable_thinking=False))
        assert text.endswith("<think>\n\n</think>\n\n")
    async with open_engine(_config(hybrid, chat={"enable_thinking": False})) as engine:
        assert engine.tokenizer.decode(engine.chat_tokens(USER)).endswith("</think>\n\n")
        assert engine.tokenizer.decode(engine.chat_tokens(USER, enable_thinking=True)).endswith(
            "<think>\n")
