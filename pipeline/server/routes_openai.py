"""OpenAI routes: chat and text completions, models, and vLLM/llama.cpp-style tokenize.

Each handler checks the whole request (schema.py, api.py), builds the prompt tokens and
one `Choice` per generation (n choices per prompt, a list of prompts on /completions),
then hands them to a reply (responses.py) that streams or collects them.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pipeline.server import grammar
from pipeline.server import schema as s
from pipeline.server import schema_out as o
from pipeline.server.api import Api
from pipeline.server.offload import check_size
from pipeline.server.prompting import Prompt, render, template_kwargs, template_messages
from pipeline.server.responses import ChatReply, Choice, TextReply, respond
from pipeline.server.transport import json_response


async def models(api: Api, request: Request) -> Response:
    api.check_auth(request)
    return json_response(o.ModelList([o.ModelCard(n, api.created) for n in api.listed_names()]))


async def model(api: Api, request: Request) -> Response:
    api.check_auth(request)
    name = request.path_params["model"]
    if name not in api.model_names():
        # Asking about a model (not asking one to generate) is a question with one answer.
        raise s.APIError(404, f"the model {name!r} does not exist; this server serves "
                         f"{api.engine.name!r}", param="model", code="model_not_found")
    return json_response(o.ModelCard(name, api.created))


def forced_tools(req: s.ChatRequest) -> list[tuple[str, dict[str, Any] | None]] | None:
    """The tools a call must be made to (tool_choice required or named), else None."""
    tools = req.tools or []
    if isinstance(req.tool_choice, s.NamedToolChoice):
        wanted = req.tool_choice.function.name
        chosen = [t for t in tools if t.function.name == wanted]
        if not chosen:
            raise s.APIError(400, f"tool_choice names {wanted!r}, which is not in tools",
                             param="tool_choice")
        return [(wanted, chosen[0].function.parameters)]
    if req.tool_choice == "required":
        if not tools:
            raise s.APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return [(t.function.name, t.function.parameters) for t in tools]
    return None


def format_grammar(fmt: s.ResponseFormat | None) -> str | None:
    if fmt is None or fmt.type == "text":
        return None
    schema = fmt.json_schema.schema_ if fmt.type == "json_schema" and fmt.json_schema else None
    return grammar.json_grammar(schema)


class ChatPlan(msgspec.Struct, frozen=True):
    """A checked chat request, ready to run: what every chat-shaped route shares."""

    name: str  # the model name the reply reports
    choices: list[Choice]
    tools: bool  # parse tool calls out of the text
    in_reasoning: bool
    schemas: dict[str, dict[str, Any]]  # tool name -> parameters schema (types XML arguments)

    def reply(self, api: Api, req: s.ChatRequest) -> ChatReply:
        reply = ChatReply(api.engine, api.metrics, req, self.name, self.choices,
                          tools=self.tools, in_reasoning=self.in_reasoning,
                          hide_reasoning=api.settings.hide_reasoning, schemas=self.schemas)
        reply.drain = api.drain
        return reply


async def chat_prompt(api: Api, req: s.ChatRequest) -> tuple[Prompt, list[int]]:
    """The request's prompt text and tokens (tools, template kwargs, prefill applied)."""
    messages = template_messages(req.messages)
    tools = [] if req.tool_choice == "none" else [msgspec.to_builtins(t) for t in req.tools or []]
    kwargs = template_kwargs(api.engine.config.chat, req.chat_template_kwargs)
    if _constrained(req) and "enable_thinking" not in (req.chat_template_kwargs or {}):
        # The grammar covers the whole reply: no room for free-text reasoning before it.
        kwargs["enable_thinking"] = False

    def work() -> tuple[Prompt, list[int]]:
        prompt = render(api.engine.tokenizer, messages, tools, kwargs,
                        continue_final=req.continue_final_message,
                        add_generation_prompt=req.add_generation_prompt)
        check_size(prompt.text, "the rendered chat template", "messages")
        return prompt, api.engine.encode(prompt.text)

    # The template is the container's code: off the event loop, within a time budget.
    return await api.offload(work, "rendering the chat template and tokenizing", "messages")


def _constrained(req: s.ChatRequest) -> bool:
    fmt = req.response_format
    return (fmt is not None and fmt.type != "text") or req.tool_choice == "required" \
        or isinstance(req.tool_choice, s.NamedToolChoice)


async def plan_chat(api: Api, req: s.ChatRequest) -> ChatPlan:
    s.check_unsupported(req)
    name = api.check_model(req.model)
    params = api.params(req)
    forced = forced_tools(req)
    fmt = req.response_format if req.response_format and req.response_format.type != "text" else None
    if forced and fmt:
        raise s.APIError(400, "response_format and a forced tool call cannot both constrain "
                         "the reply", param="response_format")
    prompt, tokens = await chat_prompt(api, req)
    api.check_prompt(tokens, params, "messages")
    make = None
    if forced:
        parallel = req.parallel_tool_calls is not False
        make = await api.constraint(lambda: grammar.tool_grammar(forced, parallel), "tools")
    elif fmt:
        make = await api.constraint(lambda: format_grammar(fmt) or "", "response_format")
    n = req.n or 1
    choices = [Choice(i, tokens, p, i == 0)
               for i, p in enumerate(api.choice_params(params, n, n, make))]
    # A grammar starts the reply with its first token, even after an opened <think>.
    in_reasoning = prompt.in_reasoning and make is None
    tools = bool(req.tools) and req.tool_choice != "none"
    schemas = {t.function.name: t.function.parameters or {} for t in req.tools or []}
    return ChatPlan(name, choices, tools or bool(forced), in_reasoning, schemas)


async def chat(api: Api, request: Request) -> Response:
    req: s.ChatRequest = await api.decode(request, s.ChatRequest)
    plan = await plan_chat(api, req)
    return await respond(request, plan.reply(api, req))


async def prompt_tokens(api: Api, prompt: str | list[Any]) -> list[list[int]]:
    """One string, token ids, or a list of strings or of token-id lists."""
    if isinstance(prompt, str):
        return [await api.encode(prompt, "prompt")]
    if not prompt:
        raise s.APIError(400, "prompt is an empty list", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [[int(t) for t in prompt]]
    if all(isinstance(p, str) for p in prompt):
        return [await api.encode(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    if all(isinstance(p, list) for p in prompt):
        return [[int(t) for t in p] for p in prompt]
    raise s.APIError(400, "prompt must be a string, a list of token ids, or a list of either "
                     "(not a mix)", param="prompt")


async def completions(api: Api, request: Request) -> Response:
    req: s.CompletionRequest = await api.decode(request, s.CompletionRequest)
    s.check_unsupported(req)
    name = api.check_model(req.model)
    params = api.params(req)
    prompts = await prompt_tokens(api, req.prompt)
    for i, tokens in enumerate(prompts):
        api.check_prompt(tokens, params, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
    make = None
    if req.response_format and req.response_format.type != "text":
        fmt = req.response_format
        make = await api.constraint(lambda: format_grammar(fmt) or "", "response_format")
    n = req.n or 1
    plist = api.choice_params(params, n, n * len(prompts), make)
    choices = [Choice(k, prompts[k // n], p, k % n == 0) for k, p in enumerate(plist)]
    reply = TextReply(api.engine, api.metrics, req, name, choices)
    reply.drain = api.drain
    return await respond(request, reply)


async def tokenize(api: Api, request: Request) -> Response:
    req: s.TokenizeRequest = await api.decode(request, s.TokenizeRequest)
    if req.messages is not None:
        messages = template_messages(req.messages)
        kwargs = template_kwargs(api.engine.config.chat, req.chat_template_kwargs)
        text = await api.offload(lambda: check_size(render(
            api.engine.tokenizer, messages, [], kwargs,
            add_generation_prompt=req.add_generation_prompt).text, "the rendered chat template",
            "messages"), "rendering the chat template", "messages")
    elif req.prompt is not None or req.content is not None:
        text = req.prompt if req.prompt is not None else req.content or ""
    else:
        raise s.APIError(400, "send `prompt` (or `content`) text, or `messages`", param="prompt")
    tokens = await api.encode(text, "prompt")
    return json_response(o.TokenizeResponse(tokens, len(tokens), api.engine.context_limit))


async def detokenize(api: Api, request: Request) -> Response:
    req: s.DetokenizeRequest = await api.decode(request, s.DetokenizeRequest)
    bad = next((t for t in req.tokens if not 0 <= t < api.vocab), None)
    if bad is not None:
        raise s.APIError(400, f"token id {bad} is outside the vocabulary [0, {api.vocab})",
                         param="tokens")
    text = await api.offload(lambda: api.engine.tokenizer.decode(req.tokens), "detokenizing",
                             "tokens")
    return json_response(o.DetokenizeResponse(text, text))
