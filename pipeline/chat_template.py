"""Extra variables for the chat template: the thinking switch, from request, call or config.

Qwen3.5/3.6 (and Qwen3 hybrid) templates read `enable_thinking`: false renders an empty
`<think>\\n\\n</think>\\n\\n` after the generation prompt, so the model answers directly.
Clients send it as `chat_template_kwargs: {"enable_thinking": false}` (vLLM's and SGLang's
field); library callers pass `enable_thinking=`; the config's `[chat] enable_thinking` is
the default for both. Templates without the switch ignore it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.config.sampling import ChatConfig

# Arguments of apply_chat_template itself: a request may not reach them through the kwargs.
RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                      "add_generation_prompt", "continue_final_message", "tokenize",
                      "padding", "truncation", "max_length", "return_tensors", "return_dict",
                      "return_assistant_tokens_mask", "tokenizer_kwargs"})


class TemplateKwargsError(ValueError):
    """A chat_template_kwargs entry that cannot be passed on; names the key."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        super().__init__(f"chat_template_kwargs.{key}: {problem}")


def template_kwargs(config: ChatConfig, enable_thinking: bool | None = None,
                    extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Variables for the template: `extra` (a request's kwargs) over the call's
    `enable_thinking` over the config's."""
    out: dict[str, Any] = {}
    if config.enable_thinking is not None:
        out["enable_thinking"] = config.enable_thinking
    if enable_thinking is not None:
        out["enable_thinking"] = enable_thinking
    for key, value in (extra or {}).items():
        if key in RESERVED:
            raise TemplateKwargsError(key, "is an argument of the template call, not a "
                                      "template variable")
        if key == "enable_thinking" and not isinstance(value, bool):
            raise TemplateKwargsError(key, f"must be true or false, got {value!r}")
        out[key] = value
    return out
