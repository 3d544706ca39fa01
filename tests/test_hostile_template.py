"""A container whose chat template never ends (nested `range(99999)` loops, each under
jinja's sandbox limit) cannot freeze the server: the template renders in a worker thread
within a budget, the request gets a 400 naming the budget, `/health` and template-free
requests keep answering meanwhile, and the thread is stopped (the next request renders).
With `--api-key`, /metrics needs the key (unless opted out) and /health names files
only to a caller with the key, never by their absolute paths. A shutdown answers a
request still rendering 503 at once instead of waiting out the budget and the grace.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import httpx2
import pytest
import trio
from test_server_errors import AUTH, CHAT, KEY, body, error_of, running_server

from pipeline.server import offload
from pipeline.server.app import serve_engine
from pipeline.server.settings import ServerSettings

ENDLESS = ("{% for a in range(99999) %}{% for b in range(99999) %}{% for c in range(99999) %}"
           "{% endfor %}{% endfor %}{% endfor %}")


def _with_template(src: Path, out: Path, template: str) -> Path:
    """A copy of `src` whose tokenizer_config.json carries `template`, listed consistently
    in the manifest (size and sha256): the container is well-formed, its template hostile."""
    shutil.copytree(src, out)
    config = out / "tokenizer_config.json"
    doc = json.loads(config.read_text())
    doc["chat_template"] = template
    config.write_text(json.dumps(doc))
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == config.name:
            data = config.read_bytes()
            entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.fixture(scope="module")
def endless(synth_checkpoint, packed, tmp_path_factory) -> Path:
    src = packed(synth_checkpoint("qwen3_next"), bits=None)
    return _with_template(src, tmp_path_factory.mktemp("template") / "endless.qpack", ENDLESS)


async def test_an_endless_template_is_a_400_the_server_keeps_answering_and_the_key_covers_metrics(
        endless) -> None:
    # One server for both halves (each open costs seconds): a 0.5 s budget and an API key.
    async with running_server(endless, prompt_budget_s=0.5, api_key=KEY) as (engine, http):
        answers: list[int] = []

        async def poll_health() -> None:  # a prober needs no key
            while True:
                answers.append((await http.get("/health")).status_code)
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll_health)
            err = error_of(await http.post(CHAT, json=body(), headers=AUTH), 400)
            nursery.cancel_scope.cancel()
        assert err["param"] == "messages"
        assert "rendering the chat template and tokenizing took longer than 0.5 s" in err["message"]
        assert "server.prompt_budget_s" in err["message"]
        # /health answered while the template ran (the event loop was never held).
        assert len(answers) >= 3 and set(answers) == {200}, answers
        # A template-free request still completes.
        ok = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                             headers=AUTH)
        assert ok.status_code == 200, ok.text
        # More endless renders than threads may run at once; then tokenizing (which takes
        # a thread too) still gets one: the stuck renders were stopped, not left running.
        for _ in range(offload.MAX_AT_ONCE + 1):
            error_of(await http.post(CHAT, json=body(), headers=AUTH), 400)
        tokenized = await http.post("/tokenize", json={"prompt": "Hi"}, headers=AUTH)
        assert tokenized.status_code == 200 and tokenized.json()["count"] >= 1, tokenized.text
        counted = await http.post("/v1/messages/count_tokens", headers=AUTH, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert counted.status_code == 400 and "took longer than" in counted.json()["error"]["message"]

        # The key covers /metrics; /health names files only to a caller with it.
        assert (await http.get("/metrics")).status_code == 401
        assert (await http.get("/metrics", headers=AUTH)).status_code == 200
        layer = endless / "experts" / "layer_001.bin"
        saved = layer.read_bytes()
        os.truncate(layer, 100)
        try:
            hidden = await http.get("/health")
            assert hidden.status_code == 503 and "layer_001" not in hidden.text, hidden.text
            shown = await http.get("/health", headers=AUTH)
            assert shown.status_code == 503
            assert shown.json()["problems"][0].startswith("experts/layer_001.bin: 100 bytes")
            assert str(endless.parent) not in shown.text  # container paths, not where it lives
        finally:
            layer.write_bytes(saved)
        # A scraper without the key, when the operator opts out for /metrics only; and the
        # shutdown of a server whose only request is still rendering: budget and grace far
        # past the hang guard, so the server must answer it 503 at once and stop (no token
        # is due to anyone). SIGTERM -> shutdown trigger is test_shutdown.py's.
        stop = trio.Event()
        statuses: list[int] = []
        with trio.fail_after(60):  # a hang guard, not a measurement
            async with trio.open_nursery() as nursery:
                port = await nursery.start(lambda task_status: serve_engine(
                    engine, ServerSettings(port=0, api_key=KEY, metrics_without_key=True,
                                           prompt_budget_s=60, shutdown_grace_s=120),
                    shutdown_trigger=stop.wait, task_status=task_status))

                async def rendering(other: httpx2.AsyncClient) -> None:
                    statuses.append((await other.post(CHAT, json=body(), headers=AUTH)).status_code)

                async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                              timeout=90) as other:
                    assert (await other.get("/metrics")).status_code == 200
                    assert (await other.post(CHAT, json=body())).status_code == 401
                    async with trio.open_nursery() as requests:
                        requests.start_soon(rendering, other)
                        await trio.sleep(0.3)  # it reaches the template within milliseconds
                        stop.set()  # serve_engine returns once the server has drained
        assert statuses == [503], statuses
