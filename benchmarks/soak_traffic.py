"""The soak's traffic (benchmarks/soak.py): one seeded request of each kind, through the
official openai and anthropic clients or a raw socket, each raising `Unexpected` where the
reply is not what it asked for."""

from __future__ import annotations

import json
import random
import socket
from collections.abc import Awaitable, Callable

import anthropic
import openai
import trio

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                             "celsius": {"type": "integer"}},
           "required": ["city", "celsius"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                         "parameters": WEATHER}}
PROMPTS = ("The quick brown fox", "Mixture-of-experts models route each token to",
           "Name three prime numbers.", "Write a haiku about disks.", "Explain caching.")


class Unexpected(Exception):
    """A reply that is not what the request asked for."""


def _user(rng: random.Random) -> list[dict[str, str]]:
    return [{"role": "user", "content": rng.choice(PROMPTS)}]


class Traffic:
    def __init__(self, port: int, rng: random.Random) -> None:
        self.port = port
        self.rng = rng
        base = f"http://127.0.0.1:{port}"
        self.oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="soak", max_retries=0,
                                      timeout=300)
        self.ant = anthropic.AsyncAnthropic(base_url=base, api_key="soak", max_retries=0,
                                            timeout=300)
        self.kinds: dict[str, Callable[[], Awaitable[None]]] = {
            "chat": self.chat, "chat_stream": self.chat_stream, "completion": self.completion,
            "completion_stream": self.completion_stream, "tools": self.tools,
            "grammar": self.grammar, "responses": self.responses, "anthropic": self.anthropic,
            "anthropic_stream": self.anthropic_stream, "cancel": self.cancel,
            "disconnect": self.disconnect}

    def tokens(self) -> int:
        return self.rng.randint(4, 16)

    async def chat(self) -> None:
        r = await self.oai.chat.completions.create(model="demo", messages=_user(self.rng),
                                                   max_tokens=self.tokens())
        if r.choices[0].finish_reason not in ("stop", "length"):
            raise Unexpected(f"finish_reason {r.choices[0].finish_reason}")

    async def chat_stream(self) -> None:
        stream = await self.oai.chat.completions.create(
            model="demo", messages=_user(self.rng), max_tokens=self.tokens(), stream=True,
            stream_options={"include_usage": True})
        finish = [c.choices[0].finish_reason async for c in stream if c.choices]
        if not finish or finish[-1] not in ("stop", "length"):
            raise Unexpected(f"stream ended without a finish reason: {finish[-3:]}")

    async def completion(self) -> None:
        r = await self.oai.completions.create(model="demo", prompt=self.rng.choice(PROMPTS),
                                              max_tokens=self.tokens())
        if r.usage is None or r.usage.completion_tokens < 1:
            raise Unexpected("no completion tokens")

    async def completion_stream(self) -> None:
        stream = await self.oai.completions.create(model="demo", prompt=self.rng.choice(PROMPTS),
                                                   max_tokens=self.tokens(), stream=True)
        if not [c async for c in stream]:
            raise Unexpected("empty stream")

    async def tools(self) -> None:
        r = await self.oai.chat.completions.create(
            model="demo", messages=_user(self.rng), max_tokens=64, tools=[TOOL],
            tool_choice="required")
        choice = r.choices[0]
        if choice.finish_reason == "tool_calls":
            json.loads(choice.message.tool_calls[0].function.arguments)  # type: ignore[index]
        elif choice.finish_reason != "length":
            raise Unexpected(f"tools: finish_reason {choice.finish_reason}")

    async def grammar(self) -> None:
        r = await self.oai.chat.completions.create(
            model="demo", messages=_user(self.rng), max_tokens=48,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "weather", "schema": WEATHER}})
        if r.choices[0].finish_reason == "stop":
            json.loads(r.choices[0].message.content or "")  # valid by construction

    async def responses(self) -> None:
        r = await self.oai.responses.create(model="demo", input=self.rng.choice(PROMPTS),
                                            max_output_tokens=self.tokens())
        if r.status not in ("completed", "incomplete"):
            raise Unexpected(f"responses: status {r.status}")

    async def anthropic(self) -> None:
        r = await self.ant.messages.create(model="demo", max_tokens=self.tokens(),
                                           messages=_user(self.rng))  # type: ignore[arg-type]
        if r.stop_reason not in ("end_turn", "max_tokens", "stop_sequence"):
            raise Unexpected(f"anthropic: stop_reason {r.stop_reason}")

    async def anthropic_stream(self) -> None:
        async with self.ant.messages.stream(model="demo", max_tokens=self.tokens(),
                                            messages=_user(self.rng)) as stream:  # type: ignore[arg-type]
            async for _ in stream:
                pass
            final = await stream.get_final_message()
        if final.stop_reason is None:
            raise Unexpected("anthropic stream without a stop reason")

    async def cancel(self) -> None:
        """A client that stops reading after two chunks and closes the stream."""
        stream = await self.oai.chat.completions.create(
            model="demo", messages=_user(self.rng), max_tokens=200, stream=True)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.close()

    async def disconnect(self) -> None:
        """A client whose connection drops mid-stream (no close, no more reads)."""
        body = json.dumps({"model": "demo", "messages": _user(self.rng), "max_tokens": 200,
                           "stream": True}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        sock = await trio.open_tcp_stream("127.0.0.1", self.port)
        try:
            await sock.send_all(head + body)
            got = b""
            with trio.fail_after(300):
                while got.count(b"data: ") < 2:
                    chunk = await sock.receive_some(65536)
                    if not chunk:
                        raise Unexpected("connection closed before two events")
                    got += chunk
            if not got.startswith(b"HTTP/1.1 200"):
                raise Unexpected(got[:80].decode(errors="replace"))
        finally:
            sock.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            await sock.aclose()  # linger 0: a reset, as a client that vanished
