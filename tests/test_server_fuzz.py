"""Hypothesis-generated request bodies for the newer server surface (structured output,
tools, logprobs, n, prefill, template kwargs, Responses, Anthropic Messages, tokenize):
never a 5xx, always an error body or a whole reply, and the engine idle afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from helpers_conformance import running
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


_SCHEMA_LEAF = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object",
                             "array", "bogus"]) | st.integers(),
    "enum": st.lists(st.integers(0, 3) | st.text(max_size=3), max_size=3),
    "maxLength": st.integers(-1, 4), "minimum": st.integers(-5, 5),
    "maximum": st.integers(-5, 5), "pattern": st.sampled_from(["^a+$", "[", "\\d{2}"]),
    "$ref": st.sampled_from(["#/nope", "#", "#/properties/a"])})
_SCHEMAS = st.recursive(_SCHEMA_LEAF, lambda inner: st.fixed_dictionaries(
    {"type": st.just("object")}, optional={
        "properties": st.dictionaries(st.text(max_size=4), inner, max_size=3),
        "required": st.lists(st.text(max_size=4), max_size=2),
        "additionalProperties": st.booleans() | inner,
        "anyOf": st.lists(inner, max_size=2)}), max_leaves=6)
_MSG = [{"role": "user", "content": "hi"}]
_TOOL = st.builds(lambda name, params: {"type": "function", "function": {
    "name": name, "parameters": params}}, st.sampled_from(["f", "g", ""]), _SCHEMAS)


@st.composite
def _bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    route = draw(st.sampled_from(["/v1/chat/completions", "/chat/completions", "/completions",
                                  "/v1/responses", "/v1/messages", "/tokenize",
                                  "/detokenize"]))
    body: dict[str, Any] = {"max_tokens": draw(st.integers(1, 2))}
    if route.endswith("chat/completions"):
        body["messages"] = draw(st.sampled_from([_MSG, [*_MSG, {"role": "assistant",
                                                              "content": draw(st.text(max_size=5))}]]))
        body.update(draw(st.fixed_dictionaries({}, optional={
            "response_format": st.one_of(
                st.just({"type": "json_object"}),
                _SCHEMAS.map(lambda sc: {"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": sc}}),
                st.dictionaries(st.text(max_size=5), st.integers(), max_size=2)),
            "tools": st.lists(_TOOL, max_size=2),
            "tool_choice": st.sampled_from(["required", "none", "auto", "bogus",
                                            {"type": "function", "function": {"name": "f"}}]),
            "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 25),
            "n": st.integers(0, 3), "logit_bias": st.dictionaries(
                st.sampled_from(["1", "-1", "x", "999999999"]), st.floats(-150, 150), max_size=2),
            "chat_template_kwargs": st.dictionaries(
                st.sampled_from(["enable_thinking", "tools", "x"]), st.booleans(), max_size=2),
            "continue_final_message": st.booleans(), "add_generation_prompt": st.booleans(),
            "cache_prompt": st.booleans(), "model": st.sampled_from(["tiny", "gpt-4o", ""])})))
    elif route == "/completions":
        body["prompt"] = draw(st.one_of(st.text(max_size=8), st.lists(st.integers(-1, 200),
                                                                      max_size=3),
                                        st.lists(st.text(min_size=1, max_size=4), max_size=3),
                                        st.lists(st.lists(st.integers(0, 200), max_size=3),
                                                 max_size=2)))
        body.update(draw(st.fixed_dictionaries({}, optional={
            "logprobs": st.integers(-1, 25), "echo": st.booleans(), "n": st.integers(0, 3),
            "best_of": st.integers(0, 3), "suffix": st.text(max_size=2)})))
    elif route == "/v1/responses":
        body = {"max_output_tokens": body["max_tokens"], "input": draw(st.one_of(
            st.text(max_size=8), st.lists(st.fixed_dictionaries({}, optional={
                "type": st.sampled_from(["message", "function_call", "function_call_output",
                                         "reasoning", "web_search"]),
                "role": st.sampled_from(["user", "assistant", "tool", "x"]),
                "content": st.text(max_size=5), "call_id": st.text(max_size=3),
                "output": st.text(max_size=3)}), max_size=3)))}
        body.update(draw(st.fixed_dictionaries({}, optional={
            "text": _SCHEMAS.map(lambda sc: {"format": {"type": "json_schema", "name": "x",
                                                        "schema": sc}}),
            "tool_choice": st.sampled_from(["required", {"type": "function", "name": "f"}]),
            "tools": st.lists(st.builds(lambda t: {"type": "function", "name": "f",
                                                   "parameters": t}, _SCHEMAS), max_size=1),
            "previous_response_id": st.just("resp_1")})))
    elif route == "/v1/messages":
        block = st.fixed_dictionaries({"type": st.sampled_from(
            ["text", "tool_use", "tool_result", "image", "thinking"])}, optional={
            "text": st.text(max_size=4), "id": st.text(max_size=3), "name": st.text(max_size=3),
            "input": st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
            "tool_use_id": st.text(max_size=3), "content": st.text(max_size=3)})
        body["messages"] = draw(st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["user", "assistant", "system"]),
            "content": st.text(max_size=5) | st.lists(block, max_size=2)}), max_size=3))
        body.update(draw(st.fixed_dictionaries({}, optional={
            "system": st.text(max_size=5), "stream": st.booleans(),
            "tool_choice": st.sampled_from([{"type": "any"}, {"type": "tool", "name": "f"},
                                            {"type": "none"}, {"type": "x"}]),
            "tools": st.lists(st.builds(lambda sc: {"name": "f", "input_schema": sc},
                                        _SCHEMAS), max_size=1)})))
    elif route == "/tokenize":
        body = draw(st.fixed_dictionaries({}, optional={
            "prompt": st.text(max_size=5), "content": st.text(max_size=5) | st.integers(),
            "messages": st.just(_MSG)}))
    else:
        body = {"tokens": draw(st.lists(st.integers(-2, 200_000), max_size=4))}
    if route != "/v1/messages" and draw(st.booleans()):
        body["stream"] = True
    return route, body


@given(case=_bodies())
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def _fuzz(http: httpx2.Client, tally: dict[str, int], case: tuple[str, dict[str, Any]]) -> None:
    route, body = case
    resp = http.post(route, json=body)
    assert resp.status_code < 500, (route, body, resp.text[:300])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert err["message"] and "Traceback" not in err["message"], err
    elif resp.headers["content-type"].startswith("text/event-stream"):
        assert '"error"' not in resp.text.replace('"error":null', ""), resp.text[-300:]
    key = f"{route} {resp.status_code}"
    tally[key] = tally.get(key, 0) + 1


async def test_fuzzed_new_surface_never_5xx(container: Path) -> None:
    async with running(container) as (engine, base):
        tally: dict[str, int] = {}
        # One client for every example: a client's SSL context costs ~40 ms of CPU to
        # build (a third of this test's time, 60 of them), and each example is still
        # its own request.
        with httpx2.Client(base_url=base, timeout=60) as http:
            await trio.to_thread.run_sync(lambda: _fuzz(http, tally))
        print("outcomes:", tally)
        assert sum(v for k, v in tally.items() if k.endswith(" 200")) >= 10, tally
        assert engine.waiting == 0 and not engine.busy
