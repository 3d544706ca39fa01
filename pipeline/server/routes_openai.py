"""OpenAI routes: chat and text completions, models, and vLLM/llama.cpp-style tokenize.

Each handler checks the whole request (schema.py, api.py), builds the prompt tokens and
one `Choice` per generation (n choices per prompt, a list of prompts on /completions),
then hands them to a reply (responses.py) that streams or collects them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pipeline.server import call_grammar, grammar
from pipeline.server import schema as s
from pipeline.server import schema_out as o
from pipeline.server.api import Api
from pipeline.server.logprobs import TokenTexts
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


def _format_grammar(req: s.ChatRequest | s.CompletionRequest) -> Callable[[], str] | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    spec = fmt.json_schema if fmt.type == "json_schema" else None
    # llama.cpp puts a json_object's schema beside the type.
    schema = spec.schema_ if spec is not None else fmt.schema_
    strict = bool(spec is not None and spec.strict)
    return lambda: grammar.json_grammar(schema, strict=strict)


def _schema_grammar(req: s.ChatRequest | s.CompletionRequest) -> Callable[[], str] | None:
    schema = req.json_schema
    return None if schema is None else lambda: grammar.json_grammar(schema)


def _gbnf_grammar(req: s.ChatRequest | s.CompletionRequest) -> Callable[[], str] | None:
    text = req.grammar
    return None if not text else lambda: grammar.gbnf_grammar(text)


# The request fields that constrain a reply's text, each with what its grammar is built
# from: OpenAI's `response_format`, llama.cpp's top-level `json_schema` and `grammar`.
OUTPUT_CONSTRAINTS: dict[str, Callable[[s.ChatRequest | s.CompletionRequest],
                                       Callable[[], str] | None]] = {
    "response_format": _format_grammar,
    "json_schema": _schema_grammar,
    "grammar": _gbnf_grammar,
}


def output_grammar(
        req: s.ChatRequest | s.CompletionRequest) -> tuple[str, Callable[[], str]] | None:
    """The field that constrains the reply's text and its grammar's builder, or None; a
    request naming two is refused (which one wins would be a guess)."""
    asked = [(field, build) for field, of in OUTPUT_CONSTRAINTS.items()
             if (build := of(req)) is not None]
    if len(asked) > 1:
        raise s.APIError(400, f"{asked[0][0]} and {asked[1][0]} cannot both constrain the reply",
                         param=asked[1][0])
    return asked[0] if asked else None


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
    return output_grammar(req) is not None or req.tool_choice == "required" \
        or isinstance(req.tool_choice, s.NamedToolChoice)


async def plan_chat(api: Api, req: s.ChatRequest) -> ChatPlan:
    s.check_unsupported(req)
    name = api.check_model(req.model)
    params = api.params(req)
    forced = forced_tools(req)
    output = output_grammar(req)
    if forced and output:
        raise s.APIError(400, f"{output[0]} and a forced tool call cannot both constrain "
                         "the reply", param=output[0])
    prompt, tokens = await chat_prompt(api, req)
    api.check_prompt(tokens, params, "messages", generations=req.n or 1)
    make = None
    if forced:
        parallel = req.parallel_tool_calls is not False
        # In the markup the container's template writes calls in (GLM's, DeepSeek's, harmony...).
        tok = api.engine.tokenizer
        style = await api.offload(lambda: call_grammar.call_style(tok), "reading the chat template's "
                                  "tool-call markup", "tools")
        make = await api.constraint(lambda: call_grammar.tool_grammar(forced, parallel, style), "tools")
    elif output:
        make = await api.constraint(output[1], output[0])
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
    return await respond(request, await plan_text(api, req))


async def plan_text(api: Api, req: s.CompletionRequest) -> TextReply:
    """A checked completion request, ready to run (also Ollama's raw /api/generate)."""
    s.check_unsupported(req)
    name = api.check_model(req.model)
    params = api.params(req)
    prompts = await prompt_tokens(api, req.prompt)
    for i, tokens in enumerate(prompts):
        api.check_prompt(tokens, params, "prompt" if len(prompts) == 1 else f"prompt[{i}]",
                         generations=(req.n or 1) * len(prompts))
    output = output_grammar(req)
    make = await api.constraint(output[1], output[0]) if output else None
    n = req.n or 1
    plist = api.choice_params(params, n, n * len(prompts), make)
    choices = [Choice(k, prompts[k // n], p, k % n == 0) for k, p in enumerate(plist)]
    reply = TextReply(api.engine, api.metrics, req, name, choices)
    reply.drain = api.drain
    return reply


async def tokenize(api: Api, request: Request) -> Response:
    req: s.TokenizeRequest = await api.decode(request, s.TokenizeRequest)
    if req.messages is not None:
        messages = template_messages(req.messages)
        tools = [msgspec.to_builtins(t) for t in req.tools or []]
        kwargs = template_kwargs(api.engine.config.chat, req.chat_template_kwargs)
        text = await api.offload(lambda: check_size(render(
            api.engine.tokenizer, messages, tools, kwargs,
            add_generation_prompt=req.add_generation_prompt).text, "the rendered chat template",
            "messages"), "rendering the chat template", "messages")
    elif req.prompt is not None or req.content is not None:
        text = req.prompt if req.prompt is not None else req.content or ""
    else:
        raise s.APIError(400, "send `prompt` (or `content`) text, or `messages`", param="prompt")
    tokens = await api.encode(text, "prompt")
    out: list[int] | list[o.TokenPiece] = tokens
    if req.with_pieces:
        texts = TokenTexts(api.engine.tokenizer)
        out = [o.TokenPiece(t, _piece(bytes(texts(t)[1]))) for t in tokens]
    return json_response(o.TokenizeResponse(out, len(tokens), api.engine.context_limit))


def _piece(raw: bytes) -> str | list[int]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def detokenize(api: Api, request: Request) -> Response:
    req: s.DetokenizeRequest = await api.decode(request, s.DetokenizeRequest)
    bad = next((t for t in req.tokens if not 0 <= t < api.vocab), None)
    if bad is not None:
        raise s.APIError(400, f"token id {bad} is outside the vocabulary [0, {api.vocab})",
                         param="tokens")
    text = await api.offload(lambda: api.engine.tokenizer.decode(req.tokens), "detokenizing",
                             "tokens")
    return json_response(o.DetokenizeResponse(text, text))
