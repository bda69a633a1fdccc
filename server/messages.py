"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the same engine.

A request becomes the chat endpoint's conversation (system → a system message; `tool_use` blocks →
an assistant's tool calls; `tool_result` blocks → tool messages; `thinking` blocks → the assistant's
reasoning), and the reply is Anthropic's: content blocks (`thinking`, `text`, `tool_use`), a
`stop_reason`, usage with `cache_read_input_tokens`, or the typed stream events. `thinking`
enabled with `budget_tokens` is V4's thinking mode, and the budget is enforced: past it the engine
allows only `</think>`. Errors come in Anthropic's `{"type": "error", "error": {...}}` shape.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator

from v4serve.server import jobs
from v4serve.server.body import parse_body
from v4serve.server.errors import ApiError, as_api_error, failure_message, validation_message
from v4serve.server.framing import KEEPALIVE, EventStream, Pacing, PromptUsage, typed_event
from v4serve.server.generation import WAKE, FrontEnd, Generation
from v4serve.server.protocol import (
    IMAGE_IGNORED,
    MAX_MESSAGES,
    MAX_STOPS,
    MAX_TOOLS,
    Fields,
    SamplingFields,
    effort_level,
    ignored,
    note_once,
    validation_context,
)
from v4serve.server.text.chat_encoding import UNSUPPORTED_IMAGE
from v4serve.server.text.output import Delta
from v4serve.server.tools import answer_grammar, plan_tools

CACHE_CONTROL = ("prompt caching is automatic: every prefix is cached without markers (under --swa-cache-mode auto "
                 "a marked request's prefix is treated as hot from its first request)")


class TextBlock(Fields):
    where: ClassVar[str] = "content[]."
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = ignored(CACHE_CONTROL)
    citations: list[Any] | None = ignored("a reply field, sent back with earlier assistant turns")


class ToolUseBlock(Fields):
    where: ClassVar[str] = "content[]."
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = ignored(CACHE_CONTROL)


class ImageSource(Fields):
    where: ClassVar[str] = "content[].source."
    type: Literal["base64", "url"]
    media_type: str | None = ignored(IMAGE_IGNORED)
    data: str | None = ignored(IMAGE_IGNORED)
    url: str | None = ignored(IMAGE_IGNORED)


class ImageBlock(Fields):
    """An image: DeepSeek-V4 reads none, so it is `[Unsupported Image]` in the prompt, as DeepSeek's converter
    writes it."""

    where: ClassVar[str] = "content[]."
    type: Literal["image"]
    source: ImageSource
    cache_control: dict[str, Any] | None = ignored(CACHE_CONTROL)


ResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(Fields):
    where: ClassVar[str] = "content[]."
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = ignored(CACHE_CONTROL)


class ThinkingBlock(Fields):
    where: ClassVar[str] = "content[]."
    type: Literal["thinking"]
    thinking: str
    signature: str | None = ignored("v4serve's thinking is plain text; nothing to verify")


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class AnthropicTool(Fields):
    where: ClassVar[str] = "tools[]."
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    # A deferred tool is not shown to the model until the client loads it (its tool search): honoured by
    # leaving it out of the prompt.
    defer_loading: bool = False
    cache_control: dict[str, Any] | None = ignored(CACHE_CONTROL)


class ServerTool(BaseModel):
    """A tool of one of Anthropic's own types (`web_search_20250305`, `bash_20250124`, ...): run by
    Anthropic's servers or defined by its schemas, never by this model. Dropped from the prompt, with a
    log line; its settings are not read."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None


def _tool_kind(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "custom" if kind in (None, "custom") else "server"


Tool = Annotated[Annotated[AnthropicTool, Tag("custom")] | Annotated[ServerTool, Tag("server")],
                 Discriminator(_tool_kind)]


class AnthropicToolChoice(Fields):
    where: ClassVar[str] = "tool_choice."
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(Fields):
    where: ClassVar[str] = "thinking."
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks come back empty


class OutputFormat(Fields):
    where: ClassVar[str] = "output_config.format."
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(Fields):
    where: ClassVar[str] = "output_config."
    effort: Literal["low", "medium", "high", "xhigh", "max", "ultra"] | None = None
    format: OutputFormat | None = None


class AnthropicMessage(Fields):
    where: ClassVar[str] = "messages[]."
    # A system turn inside the conversation is rendered as V4 renders a system prompt, at that place.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]
    # A turn's own settings (Claude Code's per-turn control): its effort holds from that turn on.
    output_config: OutputConfig | None = None


class ClearThinking(Fields):
    """`context_management` edit `clear_thinking_20251015`: the thinking of earlier assistant turns is
    dropped from the prompt, all but the last `keep` turns' (`"all"`: nothing dropped)."""

    where: ClassVar[str] = "context_management.edits[]."
    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | dict[str, Any] | None = None

    @field_validator("keep")
    @classmethod
    def _keep(cls, v: Any) -> Any:
        value = v.get("value") if isinstance(v, dict) else None
        if isinstance(v, dict) and (v.get("type") != "thinking_turns" or isinstance(value, bool)
                                    or not isinstance(value, int) or value < 1):
            raise ValueError('keep must be "all" or {"type": "thinking_turns", "value": N} with N >= 1')
        return v

    def turns_kept(self) -> int | None:
        """Assistant turns whose thinking stays (None: all of them); Anthropic's default is one."""
        if self.keep == "all":
            return None
        return 1 if self.keep is None else int(self.keep["value"])


class ContextManagement(Fields):
    where: ClassVar[str] = "context_management."
    edits: list[ClearThinking] = Field(default_factory=list, max_length=8)


class MessagesRequest(Fields):
    """Anthropic's request: every field honoured, listed as ignored, or refused (see `Fields` for
    unknown ones)."""

    model: str
    max_tokens: int = Field(..., ge=1)
    messages: list[AnthropicMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOPS)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None
    metadata: dict[str, Any] | None = ignored("an end-user id for the provider's abuse monitoring")
    service_tier: str | None = ignored("v4serve has one service tier")
    speed: str | None = ignored("v4serve has one speed")
    cache_control: dict[str, Any] | None = ignored(CACHE_CONTROL)
    # v4serve's: how this request writes window-state snapshots for later hits (see --swa-cache-mode).
    swa_cache_mode: Literal["full", "periodic", "zero", "auto"] | None = None
    # vLLM's, which its router sends in prefill/decode mode: the hand-over, and EOS kept off the first tokens.
    kv_transfer_params: dict[str, Any] | None = None
    min_tokens: int = Field(0, ge=0)


class CountTokensRequest(Fields):
    model: str
    messages: list[AnthropicMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None  # its effort can add V4's maximum-effort instruction
    context_management: ContextManagement | None = None


# ---- errors in Anthropic's shape --------------------------------------------------------------------------
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 499: "invalid_request_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(exc: Exception) -> JSONResponse:
    """The failure of a Messages request as Anthropic reports it (raises what has no HTTP meaning)."""
    error = as_api_error(exc)
    return JSONResponse(anthropic_error(error.status, error.message), status_code=error.status, headers=error.headers)


# ---- request → conversation ----------------------------------------------------------------------------------
def _text(content: str | list[Any]) -> str:
    """Blocks' text as DeepSeek's converter joins it: a blank line between blocks, an image unsupported."""
    if isinstance(content, str):
        return content
    return "\n\n".join(b.text if isinstance(b, TextBlock) else UNSUPPORTED_IMAGE for b in content)


def conversation(system: str | list[TextBlock] | None, messages: list[AnthropicMessage],
                 context: ContextManagement | None = None) -> list[dict[str, Any]]:
    """Anthropic's turns as the chat endpoint's messages (DeepSeek-V4's prompt is written from those)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": _text(system)}] if system else []
    for message in messages:
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        if message.role == "assistant":
            out.append(_assistant(blocks))
            continue
        if message.role == "system":
            if any(not isinstance(b, TextBlock) for b in blocks):
                raise ApiError(400, "a system turn holds only text blocks", param="messages")
            if any(b.text for b in blocks):
                out.append({"role": "system", "content": _text(blocks)})
            continue
        # In block order: the chat encoding merges them into one user turn, a blank line between parts.
        for block in blocks:
            if isinstance(block, ToolResultBlock):  # an error is the result's text alone, as the converter has it
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
            elif isinstance(block, ImageBlock):  # the prompt format decides how an image is written
                out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]})
            elif isinstance(block, TextBlock):
                out.append({"role": "user", "content": block.text})
            else:
                raise ApiError(400, f"a user turn cannot hold a {block.type} block", param="messages")
    for edit in context.edits if context else []:
        _clear_thinking(out, edit.turns_kept())
    return out


def _clear_thinking(turns: list[dict[str, Any]], kept: int | None) -> None:
    """Drop the thinking of all but the last `kept` assistant turns that have some."""
    thinking = [t for t in turns if t["role"] == "assistant" and t.get("reasoning_content")]
    for turn in thinking[:max(0, len(thinking) - kept)] if kept is not None else []:
        del turn["reasoning_content"]


def effort(body: MessagesRequest | CountTokensRequest) -> str | None:
    """The encoding's effort level (`protocol.effort_level`, as DeepSeek's converter maps it); the latest
    turn that sets an effort wins over the request's."""
    if any(m.output_config and m.output_config.format for m in body.messages):
        raise ApiError(400, "an output format is set for the whole request (output_config.format), not per turn",
                       param="messages")
    efforts = [m.output_config.effort for m in body.messages if m.output_config and m.output_config.effort]
    requested = efforts[-1] if efforts else (body.output_config.effort if body.output_config else None)
    return effort_level(requested)


def _assistant(blocks: list[Any]) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    calls, texts = [], []
    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            turn["reasoning_content"] = turn.get("reasoning_content", "") + block.thinking
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        else:
            raise ApiError(400, f"an assistant turn cannot hold a {block.type} block", param="messages")
    turn["content"] = "\n\n".join(texts)
    if calls:
        turn["tool_calls"] = calls
    return turn


def tool_plan(tools: list[AnthropicTool | ServerTool] | None, choice: AnthropicToolChoice | None) -> Any:
    """The tools the model is shown and may call: custom tools not deferred (Anthropic's own tool types
    are dropped with a log line: the model cannot run them)."""
    for tool in tools or []:
        if isinstance(tool, ServerTool):
            note_once(f"messages-tool-{tool.type[:64]}", "dropped a Messages tool of type %r from the prompt: the "
                      "model can call only custom tools", tool.type[:64])
    shown = [t for t in tools or [] if isinstance(t, AnthropicTool) and not t.defer_loading]
    functions = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in shown]
    kind = choice.type if choice else ("auto" if functions else "none")
    if kind == "tool" and not (choice and choice.name):
        raise ApiError(400, 'tool_choice of type "tool" needs a "name"', param="tool_choice")
    openai_choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
        {"type": "function", "function": {"name": choice.name if choice else ""}}
    parallel = not (choice and choice.disable_parallel_tool_use)
    return plan_tools(functions or None, openai_choice if functions or kind != "auto" else None, parallel)


def thinking_mode(config: ThinkingConfig | None, max_tokens: int | None, default: bool) -> tuple[bool, int | None]:
    """(thinking on, its token budget): `enabled` with its budget, `adaptive` as V4 thinks, none given
    `default` (the daemon's: DeepSeek's converter thinks)."""
    if config is None:
        return default, None
    if config.type == "disabled":
        return False, None
    if config.type == "adaptive":
        return True, None
    budget = config.budget_tokens
    if budget is None:
        raise ApiError(400, "thinking.budget_tokens is required when thinking is enabled", param="thinking")
    if max_tokens is not None and budget >= max_tokens:
        raise ApiError(400, "thinking.budget_tokens must be less than max_tokens", param="thinking.budget_tokens")
    return True, budget


# ---- preprocessing (jobs for `preprocess.Preprocessor`: the body's bytes in, parsed again there) ---------------
class CountTokensHead(BaseModel):
    """What the front end reads of a count_tokens body itself (the model); the rest is validated where it
    is counted, in a preprocessing worker: validating a body of thousands of blocks holds the GIL."""

    model_config = ConfigDict(extra="ignore")

    model: str


def counted(tokenizer: Any, data: bytes, unknown_fields: str, default_thinking: bool) -> int:
    """count_tokens: the tokens of the conversation's prompt."""
    try:
        body = CountTokensRequest.model_validate_json(data, strict=True, context=validation_context(unknown_fields))
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise ApiError(400, message, param=param) from None
    tools = tool_plan(body.tools, body.tool_choice)
    thinking, _ = thinking_mode(body.thinking, None, default_thinking)
    turns = conversation(body.system, body.messages, body.context_management)
    return len(jobs.encode_chat(tokenizer, turns, sys.maxsize, thinking=thinking, tools=tools.offered,
                                reasoning_effort=effort(body), call_prefill=_prefills(body, tools, thinking)))


def _prefills(body: MessagesRequest | CountTokensRequest, tools: Any, thinking: bool) -> bool:
    """A named tool (chat mode) opens the tool-call block in the prompt, as DeepSeek's converter writes it;
    `any` leaves the block to the model (the grammar still holds the reply to a call)."""
    return tools.forced is not None and not thinking and body.tool_choice is not None \
        and body.tool_choice.type == "tool"


def prepared(tokenizer: Any, data: bytes, think_end_id: int | None, max_len: int,
             unknown_fields: str, default_thinking: bool) -> tuple[jobs.Prepared, bool]:
    """(the prompt, its tools and output grammar; whether a block carries a `cache_control` mark)."""
    body = MessagesRequest.model_validate_json(data, strict=True, context=validation_context(unknown_fields))
    thinking, _ = thinking_mode(body.thinking, body.max_tokens, default_thinking)
    think_end = think_end_id if thinking else None
    tools = tool_plan(body.tools, body.tool_choice)
    output = body.output_config or OutputConfig()
    response_format = output.format and {"type": "json_schema",
                                         "json_schema": {"name": "output", "schema": output.format.schema_}}
    prefill = _prefills(body, tools, thinking)
    grammar = answer_grammar(tools, response_format, think_end, prefill)
    turns = conversation(body.system, body.messages, body.context_management)
    prompt = jobs.encode_chat(tokenizer, turns, max_len, thinking=thinking, tools=tools.offered,
                              reasoning_effort=effort(body), call_prefill=prefill)
    return jobs.Prepared(prompt, tools.parse_calls, tools.parallel, grammar, prefill), _marked(body)


def _marked(body: MessagesRequest) -> bool:
    blocks = [*(body.system if isinstance(body.system, list) else []), *(body.tools or []),
              *(b for m in body.messages if isinstance(m.content, list) for b in m.content)]
    return body.cache_control is not None or any(getattr(b, "cache_control", None) is not None for b in blocks)


# ---- the endpoints -------------------------------------------------------------------------------------------
async def count_tokens(front: FrontEnd, raw: Request) -> Response:
    try:
        head = await parse_body(raw, CountTokensHead)
        front.check_model(head.model)
        count = await front.prep.run(counted, await raw.body(), front.config.unknown_fields,
                                     front.config.default_thinking)
    except Exception as exc:
        return error_response(exc)
    return JSONResponse({"input_tokens": count})


async def messages(front: FrontEnd, raw: Request) -> Response:
    try:
        body: MessagesRequest = await parse_body(raw, MessagesRequest)
        model = front.check_model(body.model)
        generation = await _generation(front, body, raw, await raw.body())
    except Exception as exc:
        return error_response(exc)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    if body.stream:
        return EventStream(_stream(generation, message_id, model, shown(body)),
                           pacing=Pacing(front.config.stream_keepalive, lambda: typed_event("ping", {}),
                                         generation.wake))
    try:
        (deltas,) = await front.collect(generation, raw)
    except Exception as exc:
        return error_response(exc)
    return JSONResponse({"id": message_id, "type": "message", "role": "assistant", "model": model,
                         "content": _blocks(deltas, shown(body)), **_stop(generation, deltas[-1]),
                         "usage": _usage(generation.usage()), **generation.transfer_reply()})


async def _generation(front: FrontEnd, body: MessagesRequest, raw: Request, data: bytes) -> Generation:
    thinking, budget = thinking_mode(body.thinking, body.max_tokens, front.config.default_thinking)
    think_end = front.think_end_id if thinking else None
    ready, marked = await front.prep.run(prepared, data, front.think_end_id, front.config.max_model_len,
                                         front.config.unknown_fields, front.config.default_thinking)
    # A `cache_control` mark says the client will send this prefix again: under `auto` the request then
    # snapshots as `periodic` from its first time, instead of waiting for a hit to make its prefix hot.
    mode = body.swa_cache_mode or ("periodic" if marked and front.config.swa_cache_mode == "auto" else None)
    try:
        fields = SamplingFields.model_validate({"temperature": body.temperature, "top_p": body.top_p,
                                               "top_k": body.top_k, "stop": body.stop_sequences,
                                               "swa_cache_mode": mode, "stream": body.stream,
                                               "kv_transfer_params": body.kv_transfer_params,
                                               "min_tokens": body.min_tokens})
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise ApiError(400, message.replace("stop", "stop_sequences", 1),
                       param=param and param.replace("stop", "stop_sequences", 1)) from None
    options = front.output_options(fields, reasoning_end_token=think_end, tool_calls=ready.parse_calls,
                                   parallel_tool_calls=ready.parallel, inside_tool_calls=ready.inside_calls)
    rid = f"msg-{uuid.uuid4().hex}"
    generation = front.generation(rid, ready.prompt.tolist(), fields, body.max_tokens, None, options,
                                  grammar=ready.grammar, thinking_budget=budget)
    await front.check([generation], raw)
    return generation


# ---- the reply -----------------------------------------------------------------------------------------------
def shown(body: MessagesRequest) -> bool:
    """Whether the thinking is returned (`display: "omitted"` asks for empty thinking blocks)."""
    return not (body.thinking and body.thinking.display == "omitted")


def _blocks(deltas: list[Delta], show_thinking: bool) -> list[dict[str, Any]]:
    thinking = "".join(d.reasoning for d in deltas) if show_thinking else ""
    text = "".join(d.text for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in (c for delta in deltas for c in delta.tool_calls):
        call = calls.setdefault(d.index, {"id": tool_use_id(d.id), "name": d.name, "arguments": ""})
        call["arguments"] += d.arguments
    blocks: list[dict[str, Any]] = []
    if thinking or (not show_thinking and any(d.reasoning for d in deltas)):
        blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if text:
        blocks.append({"type": "text", "text": text})
    blocks += [{"type": "tool_use", "id": c["id"], "name": c["name"], "input": partial_json(c["arguments"])}
               for _, c in sorted(calls.items())]
    return blocks


def tool_use_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or uuid.uuid4().hex).removeprefix("call_")


def partial_json(text: str) -> dict[str, Any]:
    """A call's arguments as an object, however much of it there is (a call cut off by max_tokens
    gives what it has: each open string, array and object closed, an unfinished member dropped)."""
    for candidate in _closings(text):
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        return value if isinstance(value, dict) else {}
    return {}


def _closings(text: str) -> list[str]:
    """`text` completed by closing what is open, then the same cut back to each earlier comma."""
    out, cut = [], len(text)
    while cut > 0:
        head = text[:cut]
        out.append(head + _closers(head))
        cut = head.rfind(",")
    return out


def _closers(text: str) -> str:
    stack: list[str] = []
    quoted = escaped = False
    for ch in text:
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
    return ('"' if quoted else "") + "".join(reversed(stack))


def _stop(generation: Generation, last: Delta) -> dict[str, Any]:
    matched = generation.texts[0].content.stop_reason
    reason = {"length": "max_tokens", "tool_calls": "tool_use"}.get(last.finish_reason or "", "end_turn")
    if matched is not None:
        reason = "stop_sequence"
    return {"stop_reason": reason, "stop_sequence": matched}


def _usage(usage: PromptUsage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


class _Blocks:
    """The stream's content blocks: one open at a time, each started, filled by deltas, stopped."""

    def __init__(self) -> None:
        self.index, self.open = -1, None  # the open block: "thinking", "text" or a call's index

    def switch(self, kind: Any, start: dict[str, Any]) -> list[str]:
        if self.open == kind:
            return []
        out = self.close()
        self.index, self.open = self.index + 1, kind
        return [*out, typed_event("content_block_start", {"index": self.index, "content_block": start})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [typed_event("content_block_stop", {"index": self.index})]

    def delta(self, body: dict[str, Any]) -> str:
        return typed_event("content_block_delta", {"index": self.index, "delta": body})


async def _stream(generation: Generation, message_id: str, model: str, show_thinking: bool) -> AsyncIterator[str]:
    """Anthropic's events. `message_start` waits for the engine's first output, which says how much of the
    prompt the cache held: its usage is then what a non-streamed reply says (pings keep the stream alive
    until then: `framing.Pacing`)."""
    blocks, started, opened = _Blocks(), time.monotonic(), False
    try:
        async with contextlib.aclosing(generation.deltas()) as deltas:
            async for delta in deltas:
                if delta is WAKE:
                    yield KEEPALIVE
                    continue
                if not opened:
                    opened = True
                    yield typed_event("message_start", {"message": {
                        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                        "stop_reason": None, "stop_sequence": None,
                        "usage": {**_usage(generation.usage()), "output_tokens": 0}}})
                    yield typed_event("ping", {})
                if delta.error:
                    yield typed_event("error", {"error": anthropic_error(400 if delta.error_param else 500,
                                                                   delta.error)["error"]})
                    return
                for piece in _pieces(blocks, delta, show_thinking):
                    yield piece
                if delta.finished:
                    for piece in blocks.close():
                        yield piece
                    yield typed_event("message_delta", {"delta": _stop(generation, delta),
                                                        "usage": _usage(generation.usage())})
                    yield typed_event("message_stop", {})
    except Exception as exc:  # after the first byte an error can only be an event
        why = failure_message(exc, "a stream failed")
        failed = f"the stream failed after {time.monotonic() - started:.1f} s: {why}"
        yield typed_event("error", {"error": anthropic_error(500, failed)["error"]})


def _pieces(blocks: _Blocks, delta: Delta, show_thinking: bool) -> list[str]:
    out: list[str] = []
    if delta.reasoning:
        out += blocks.switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        if show_thinking:
            out.append(blocks.delta({"type": "thinking_delta", "thinking": delta.reasoning}))
    if delta.text:
        out += blocks.switch("text", {"type": "text", "text": ""})
        out.append(blocks.delta({"type": "text_delta", "text": delta.text}))
    for call in delta.tool_calls:
        if call.id is not None:
            out += blocks.switch(("call", call.index), {"type": "tool_use", "id": tool_use_id(call.id),
                                                        "name": call.name, "input": {}})
        if call.arguments:
            out.append(blocks.delta({"type": "input_json_delta", "partial_json": call.arguments}))
    return out
