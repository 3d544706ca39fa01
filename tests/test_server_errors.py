"""Refusals as OpenAI error bodies, limits, a full queue, and clients that hang up mid-stream.

Raw HTTP (httpx2) so the bodies can be wrong on purpose; after every refusal the server
must still serve.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from helpers_server import serving

from pipeline.engine import Engine

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


@asynccontextmanager
async def running_server(container: Path, server: dict[str, Any] | None = None,
                         **serve_kw: Any) -> AsyncIterator[tuple[Engine, httpx2.AsyncClient]]:
    async with serving(container, server, **serve_kw) as (engine, port):
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            yield engine, http


def no_eos(engine: Engine) -> dict[str, float]:
    """A `logit_bias` that keeps a long answer going: the tiny models' small vocabulary
    lets greedy decoding meet an end-of-sequence token within a few hundred tokens."""
    return {str(t): -100.0 for t in engine.tokenizer.eos_token_ids}


def body(**over: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **over}


def error_of(resp: httpx2.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"]
    return err


async def until(predicate: Any) -> None:
    with trio.fail_after(60):
        while not predicate():
            await trio.sleep(0.02)


async def test_refusals_name_what_is_wrong(container: Path) -> None:
    async with running_server(container, {"context_limit": 48}, api_key=KEY,
                              max_body_bytes=4096, strict_model=True) as (engine, http):
        # Auth: missing and wrong keys; /health stays open for probes.
        error_of(await http.post(CHAT, json=body()), 401)
        err = error_of(await http.post(CHAT, json=body(), headers={"Authorization": "Bearer no"}),
                       401)
        assert err["code"] == "invalid_api_key"
        assert (await http.get("/health")).status_code == 200

        async def refused(status: int, **kw: Any) -> dict[str, Any]:
            return error_of(await http.post(kw.pop("path", CHAT), headers=AUTH, **kw), status)

        err = await refused(400, content=b'{"model": "tiny", "messages": [')
        assert "not valid JSON" in err["message"]
        assert (await refused(400, json=body(temperature="hot")))["param"] == "temperature"
        assert (await refused(400, json=body(temperature=3.5)))["param"] == "temperature"
        assert (await refused(400, json=body(top_p=0)))["param"] == "top_p"
        assert (await refused(400, json=body(max_tokens=0)))["param"] == "max_tokens"
        assert (await refused(400, json=body(stop=[""])))["param"] == "stop"
        assert (await refused(400, json=body(n=99)))["param"] == "n"
        err = await refused(400, json=body(logprobs=True, top_logprobs=50))
        assert err["param"] == "top_logprobs"
        assert (await refused(400, json=body(logit_bias={"x": 1})))["param"] == "logit_bias"
        assert (await refused(400, json=body(logit_bias={"5": 500})))["param"] == "logit_bias"
        # Unknown fields are ignored, but a known field of the wrong type is still refused.
        assert (await refused(400, json=body(n_predict=3, stream="yes")))["param"] == "stream"
        err = await refused(400, json=body(chat_template_kwargs={"tools": []}))
        assert err["param"] == "chat_template_kwargs.tools"
        assert "chat_template_kwargs.tools" in err["message"]
        err = await refused(400, json=body(chat_template_kwargs={"enable_thinking": "no"}))
        assert err["param"] == "chat_template_kwargs.enable_thinking"
        assert (await refused(400, json={"model": "tiny"}))["param"] == "messages"
        assert (await refused(400, json=body(messages=[])))["param"] == "messages"
        err = await refused(400, json=body(messages=[{"role": "wizard", "content": "x"}]))
        assert err["param"] == "messages[0].role"
        image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
        err = await refused(400, json=body(messages=[{"role": "user", "content": image}]))
        assert err["param"] == "messages[0].content[0].type" and "image_url" in err["message"]
        bad_args = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]
        err = await refused(400, json=body(messages=bad_args))
        assert err["param"] == "messages[1].tool_calls[0].function.arguments"
        err = await refused(400, json=body(tool_choice={"type": "function",
                                                        "function": {"name": "ghost"}}))
        assert err["param"] == "tool_choice"

        # Anthropic clients send the key as x-api-key, and get Anthropic-shaped errors.
        msgs = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        assert (await http.post("/v1/messages", json=msgs,
                                headers={"x-api-key": KEY})).status_code == 200
        wrong = await http.post("/v1/messages", json=msgs, headers={"x-api-key": "nope"})
        assert wrong.status_code == 401
        assert wrong.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": wrong.json()["error"]["message"]}}

        # Unknown model (the server is strict here) and route.
        err = await refused(404, json=body(model="gpt-4"))
        assert err["param"] == "model" and err["code"] == "model_not_found"
        error_of(await http.get("/v1/models/gpt-4", headers=AUTH), 404)
        error_of(await http.get("/v1/nothing-here", headers=AUTH), 404)

        # Prompt over the context limit (48 tokens).
        long = body(messages=[{"role": "user", "content": "word " * 80}])
        err = await refused(400, json=long)
        assert err["code"] == "context_length_exceeded" and "48" in err["message"]
        err = await refused(400, path="/v1/completions",
                            json={"model": "tiny", "prompt": "word " * 80})
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        err = await refused(400, path="/v1/completions",
                            json={"model": "tiny", "prompt": [1, 10**9]})
        assert "vocabulary" in err["message"]

        # Bodies over the limit: by Content-Length, and counted while reading (chunked).
        big = json.dumps(body(user="x" * 5000)).encode()
        err = await refused(413, content=big)
        assert "4096" in err["message"]

        async def chunked() -> AsyncIterator[bytes]:
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]

        error_of(await http.post(CHAT, headers=AUTH, content=chunked()), 413)

        # Still serving, and the engine is idle and clean.
        ok = await http.post(CHAT, headers=AUTH, json=body())
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"
        assert engine.waiting == 0 and not engine.busy
        metrics = (await http.get("/metrics", headers=AUTH)).text  # the key covers /metrics
        assert 'moestream_requests_total{path="/v1/chat/completions",status="400"}' in metrics
        assert 'status="413"' in metrics and 'status="401"' in metrics


async def sse_chunks(lines: AsyncIterator[str], n: int) -> list[dict[str, Any]]:
    """The next `n` SSE data chunks; the iterator stays open (closing it hangs up)."""
    chunks = []
    while len(chunks) < n:
        line = await anext(lines)
        if line.startswith("data: "):
            chunks.append(json.loads(line[6:]))
    return chunks


async def test_every_choice_a_request_queues_counts_against_the_queue(container: Path) -> None:
    """n choices (and a completion's prompts) wait as n generations: one request with more
    of them than the queue has room for is a 429, while an empty queue takes any one."""
    async with running_server(container, max_queue=3, max_batch=1) as (engine, http):
        long = body(max_tokens=2000, stream=True, logit_bias=no_eos(engine))
        async with trio.open_nursery() as nursery:
            async with http.stream("POST", CHAT, json=long) as a:
                lines = a.aiter_lines()  # kept: a dropped line iterator closes the stream
                await sse_chunks(lines, 2)
                nursery.start_soon(partial(http.post, CHAT, json=body(max_tokens=2)))
                await until(lambda: engine.waiting == 1)
                err = error_of(await http.post(CHAT, json=body(n=3)), 429)
                assert err["code"] == "queue_full"
                err = error_of(await http.post("/v1/completions", json={
                    "model": "tiny", "prompt": ["Hi", "Ho"], "n": 2, "max_tokens": 2}), 429)
                assert err["code"] == "queue_full"
        ok = await http.post(CHAT, json=body(n=4, max_tokens=2))  # the queue is empty again
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


async def test_queue_full_and_disconnects(container: Path) -> None:
    async with running_server(container, max_queue=1, max_batch=1) as (engine, http):
        # A streams a long answer and holds the engine; B waits for it; C finds the queue full.
        long = body(max_tokens=2000, stream=True, logit_bias=no_eos(engine))
        results: dict[str, httpx2.Response] = {}

        async def post(name: str, payload: dict[str, Any]) -> None:
            results[name] = await http.post(CHAT, json=payload)

        async with trio.open_nursery() as nursery:
            async with http.stream("POST", CHAT, json=long) as a:
                assert a.status_code == 200
                lines = a.aiter_lines()
                first = await sse_chunks(lines, 2)
                assert first[0]["choices"][0]["delta"]["role"] == "assistant"
                nursery.start_soon(post, "b", body(max_tokens=2))
                await until(lambda: engine.waiting == 1)
                err = error_of(await http.post(CHAT, json=body()), 429)
                assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
                # Leaving the block hangs up on A mid-stream: B must get the engine next.
        assert results["b"].status_code == 200
        assert results["b"].json()["usage"]["completion_tokens"] <= 2

        # A hang-up with nobody waiting: the generation is closed, the pool unpinned.
        for path, payload in ((CHAT, long),
                              ("/v1/completions", {"model": "tiny", "prompt": "Hi",
                                                   "max_tokens": 2000, "stream": True,
                                                   "logit_bias": no_eos(engine)})):
            async with http.stream("POST", path, json=payload) as a:
                await sse_chunks(a.aiter_lines(), 2)
            await until(lambda: not engine.busy)
            snapshot = engine.pool_snapshot()
            assert snapshot["pinned"] == 0 and snapshot["loads_in_flight"] == 0

        # A non-streaming request whose client gives up is cancelled too.
        with trio.move_on_after(1.5):
            await http.post(CHAT, json=body(max_tokens=2000, logit_bias=no_eos(engine)))
        await until(lambda: not engine.busy)
        assert engine.pool_snapshot()["pinned"] == 0

        ok = await http.post(CHAT, json=body(max_tokens=3))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 3
        assert engine.waiting == 0
