"""Chat requests -> prompt text: the messages as the chat template wants them, template
variables from the client (`chat_template_kwargs`), and assistant prefill.

A conversation that ends with an assistant message is continued: the model writes on
from the end of that message instead of opening a new turn (what llama.cpp and mlx-lm
do, and what vLLM calls `continue_final_message`). The reply holds only the new text.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from pipeline import chat_template
from pipeline.config.sampling import ChatConfig
from pipeline.server import schema as s


class Prompt(msgspec.Struct, frozen=True):
    text: str
    in_reasoning: bool  # the prompt opens <think>: the output starts inside reasoning
    prefill: bool  # continues the last (assistant) message


def template_messages(messages: list[s.Message]) -> list[dict[str, Any]]:
    """Request messages as the chat template wants them (tool-call arguments as dicts)."""
    if not messages:
        raise s.APIError(400, "messages must hold at least one message", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": text_of(m.content, f"messages[{i}].content")}
        if m.tool_calls:
            if m.role != "assistant":
                raise s.APIError(400, f"only assistant messages carry tool_calls, not {m.role!r}",
                                 param=f"messages[{i}].tool_calls")
            calls = []
            for j, call in enumerate(m.tool_calls):
                try:
                    args = json.loads(call.function.arguments or "{}")
                except ValueError as exc:
                    raise s.APIError(400, f"tool call arguments are not JSON: {exc}",
                                     param=f"messages[{i}].tool_calls[{j}].function.arguments"
                                     ) from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def string_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each tool call's arguments as JSON text instead of a mapping."""
    def text(call: dict[str, Any]) -> dict[str, Any]:
        fn = call["function"]
        return {**call, "function": {**fn, "arguments": json.dumps(fn["arguments"], ensure_ascii=False)}}

    return [{**m, "tool_calls": [text(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


def text_of(content: str | list[s.ContentPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in ("text", "input_text", "output_text") or part.text is None:
            raise s.APIError(400, f"content part type {part.type!r} is not supported (only "
                             "'text' parts with a text field)", param=f"{param}[{j}].type")
        texts.append(part.text)
    return "".join(texts)


def template_kwargs(config: ChatConfig, given: dict[str, Any] | None) -> dict[str, Any]:
    """Template variables: the request's `chat_template_kwargs` over the config's
    `[chat]` defaults; a key the server sets itself, or a bad value, is a 400 naming it."""
    try:
        return chat_template.template_kwargs(config, None, given)
    except chat_template.TemplateKwargsError as exc:
        raise s.APIError(400, str(exc), param=f"chat_template_kwargs.{exc.key}") from None


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
           kwargs: dict[str, Any], *, continue_final: bool | None = None,
           add_generation_prompt: bool | None = None) -> Prompt:
    """The prompt text for `messages`; continues a final assistant message unless the
    client asked for a new turn (`add_generation_prompt: true`)."""
    last = messages[-1]
    prefill = (continue_final if continue_final is not None
               else last["role"] == "assistant" and not last.get("tool_calls")
               and add_generation_prompt is not True)
    if prefill and (last["role"] != "assistant" or last.get("tool_calls")):
        raise s.APIError(400, "continue_final_message needs a final assistant message "
                         "without tool calls", param="messages")
    prefix = last["content"] if prefill else ""
    if prefill and not prefix:
        # Nothing to continue: the same as opening the assistant turn.
        messages, prefill = messages[:-1], False
        if not messages:
            raise s.APIError(400, "messages must hold more than an empty assistant message",
                             param="messages")
    gen_prompt = not prefill if add_generation_prompt is None else add_generation_prompt
    extra = {"tools": tools} if tools else {}

    def apply(msgs: list[dict[str, Any]]) -> str:
        return str(tokenizer.apply_chat_template(msgs, tokenize=False,
                                                 add_generation_prompt=gen_prompt and not prefill,
                                                 **extra, **kwargs))

    try:
        try:
            text = apply(messages)
        except TypeError:
            # A template that joins tool-call arguments as text (DeepSeek-V3.1's, `name +
            # '<｜tool▁sep｜>' + arguments`) takes no mapping: give it the JSON text.
            if not any(m.get("tool_calls") for m in messages):
                raise
            text = apply(string_arguments(messages))
    except Exception as exc:  # jinja raises for conversations the template refuses
        raise s.APIError(400, f"the chat template refused the messages: {exc}",
                         param="messages") from None
    if prefill:
        # The template closes the turn after the content (<|im_end|> ...): cut it there.
        end = text.rfind(prefix)
        if end < 0:
            raise s.APIError(400, "the chat template rewrote the final assistant message, so "
                             "it cannot be continued", param="messages")
        text = text[: end + len(prefix)]
    return Prompt(text, in_reasoning=text.rstrip().endswith("<think>"), prefill=prefill)
