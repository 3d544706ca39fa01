"""Shared parts of the conformance tests: a served tiny container, clients, and the
schemas whose constrained outputs are checked field by field."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
from helpers_server import serving

from pipeline.engine import Engine


@asynccontextmanager
async def running(container: Path, **serve_kw: Any) -> AsyncIterator[tuple[Engine, str]]:
    async with serving(container, {"context_limit": 512}, prefill_chunk=64,
                       **serve_kw) as (engine, port):
        yield engine, f"http://127.0.0.1:{port}"


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)


USER = [{"role": "user", "content": "Tell me about Paris."}]


WEATHER = {"type": "object", "properties": {
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "city": {"type": "string", "maxLength": 6},
    "alerts": {"type": "boolean"}},
    "required": ["unit", "days", "city", "alerts"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]


def check_weather(obj: Any) -> None:
    assert isinstance(obj, dict) and set(obj) == {"unit", "days", "city", "alerts"}, obj
    assert obj["unit"] in ("celsius", "fahrenheit") and type(obj["days"]) is int
    assert 1 <= obj["days"] <= 7 and isinstance(obj["alerts"], bool)
    assert isinstance(obj["city"], str) and len(obj["city"]) <= 6
