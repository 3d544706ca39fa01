"""Load: 8 concurrent streaming clients x 5 requests on loopback, some hanging up mid-stream.

Every request either completes (a whole SSE stream ending in [DONE]) or gets a 429
(the queue is kept short on purpose), a hang-up never disturbs the others, and after
the storm nothing is left behind: no pinned slots, no reads in flight, nobody waiting,
no extra trio tasks, the pool's storage the same size, and RSS growth bounded.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx2
import psutil
import pytest
import trio

from pipeline.config.loading import config_from_dict
from pipeline.engine import Engine, open_engine
from pipeline.server.app import serve_engine
from pipeline.server.settings import ServerSettings

CLIENTS, REQUESTS, MAX_TOKENS, MAX_QUEUE = 8, 5, 4, 4
RSS_GROWTH_MB = 200  # generous: allocator caches and httpx state, but not per-request growth


@pytest.fixture(scope="module")
def container(synth_checkpoint, packed) -> Path:
    return packed(synth_checkpoint("qwen3_next"), bits=None)


def count_tasks() -> int:
    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())


def assert_idle(engine: Engine) -> None:
    snapshot = engine.pool_snapshot()
    table = engine._core.router.table
    assert snapshot["pinned"] == 0, snapshot
    assert snapshot["loads_in_flight"] == 0, snapshot
    assert [k for k in table.resident() if table.state(k) == "loading"] == []
    assert engine.waiting == 0 and not engine.busy


async def settle(engine: Engine) -> int:
    """Until the engine is free and the task count has not moved for half a second (closed
    connections take a moment to end their server tasks); returns that count."""
    with trio.fail_after(30):
        while engine.busy:
            await trio.sleep(0.05)
        counts = [-1]
        while len(counts) < 5 or len(set(counts[-5:])) > 1:
            await trio.sleep(0.1)
            counts.append(count_tasks())
        return counts[-1]


def body(i: int, j: int) -> dict[str, Any]:
    if j % 2:
        return {"model": "tiny", "prompt": f"client {i} request {j}:", "max_tokens": MAX_TOKENS,
                "stream": True, "seed": i * 100 + j}
    return {"model": "tiny", "messages": [{"role": "user", "content": f"hello {i}/{j}"}],
            "max_tokens": MAX_TOKENS, "stream": True, "seed": i * 100 + j,
            "stream_options": {"include_usage": True}}


async def one_request(http: httpx2.AsyncClient, i: int, j: int, outcomes: Counter[str]) -> None:
    payload = body(i, j)
    path = "/v1/completions" if "prompt" in payload else "/v1/chat/completions"
    hang_up = (i + j) % 5 == 0
    async with http.stream("POST", path, json=payload) as resp:
        if resp.status_code == 429:
            err = json.loads(await resp.aread())["error"]
            assert err["code"] == "queue_full", err
            outcomes["429"] += 1
            return
        assert resp.status_code == 200, await resp.aread()
        events: list[str] = []
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if hang_up and len(events) == 2:
                    outcomes["hung up"] += 1
                    return  # leaving the block closes the connection mid-stream
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert finishes in (["length"], ["stop"]), chunks
    outcomes["completed"] += 1


@pytest.mark.slow
async def test_concurrent_streaming_clients_leave_nothing_behind(container: Path) -> None:
    cfg = config_from_dict({"model": {"path": str(container)}, "pool": {"slots": 16},
                            "compute": {"prefill_chunk": 4}})
    process = psutil.Process()
    async with open_engine(cfg) as engine, trio.open_nursery() as server:
        port = await server.start(lambda task_status: serve_engine(
            engine, ServerSettings(port=0, max_queue=MAX_QUEUE), task_status=task_status))
        base = f"http://127.0.0.1:{port}"
        async with httpx2.AsyncClient(base_url=base, timeout=120) as http:  # warm-up
            assert (await http.post("/v1/completions", json={
                "model": "tiny", "prompt": "warm", "max_tokens": MAX_TOKENS})).status_code == 200
        tasks0 = await settle(engine)
        rss0, pool0 = process.memory_info().rss, engine.pool_bytes
        assert_idle(engine)

        outcomes: Counter[str] = Counter()

        async def client(i: int) -> None:
            limits = httpx2.Limits(max_connections=1)
            async with httpx2.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
                for j in range(REQUESTS):
                    await one_request(http, i, j, outcomes)

        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                for i in range(CLIENTS):
                    nursery.start_soon(client, i)
        print("load outcomes:", dict(outcomes))  # quoted by docs/reliability.md's table
        assert sum(outcomes.values()) == CLIENTS * REQUESTS, outcomes
        assert outcomes["completed"] > CLIENTS * REQUESTS // 4, outcomes
        assert outcomes["hung up"] > 0, outcomes

        assert await settle(engine) == tasks0
        assert_idle(engine)
        assert engine.pool_bytes == pool0
        growth_mb = (process.memory_info().rss - rss0) / 2**20
        print(f"rss growth: {growth_mb:.1f} MiB")
        assert growth_mb < RSS_GROWTH_MB, growth_mb
        # And it still answers, identically seeded requests identically.
        async with httpx2.AsyncClient(base_url=base, timeout=120) as http:
            again = [(await http.post("/v1/completions", json={
                "model": "tiny", "prompt": "same", "max_tokens": MAX_TOKENS, "seed": 5,
                "temperature": 1.0})).json()["choices"][0]["text"] for _ in range(2)]
        assert again[0] == again[1]
        server.cancel_scope.cancel()
