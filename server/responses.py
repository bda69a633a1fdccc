"""`POST /v1/responses` (OpenAI's Responses API), `GET` and `DELETE /v1/responses/{id}`.

`input` (a string or items: messages, `function_call`, `function_call_output`, `reasoning`) and
`instructions` become the chat endpoint's conversation; the reply is a response object whose
`output` holds `reasoning`, `message` and `function_call` items, or the typed stream events.

Stored responses (`store`, the default) make `previous_response_id` cheap: a follow-up's prompt is
the earlier response's prompt and output token for token, then only its new items rendered after
them, so the engine resumes from the earlier response's end and its cache hit covers everything
before the new items. The store is bounded (responses and tokens, least recently used dropped
first) and kept per API key: a response is found only with the key that made it. With several
API-server processes (`--api-server-count`) it is shared through files (`SharedStoredResponses`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import tempfile
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from v4serve.server import jobs
from v4serve.server.errors import ApiError, echo, failure_message
from v4serve.server.framing import KEEPALIVE, EventStream, Pacing, PromptUsage, typed_event
from v4serve.server.generation import WAKE, FrontEnd, Generation
from v4serve.server.protocol import (
    IMAGE_IGNORED,
    MAX_MESSAGES,
    MAX_TOOLS,
    Fields,
    SamplingFields,
    effort_level,
    ignored,
    note_once,
    validation_context,
)
from v4serve.server.tenants import CURRENT_CALLER
from v4serve.server.text.chat_encoding import UNSUPPORTED_IMAGE, prompt_format_of
from v4serve.server.text.output import Delta
from v4serve.server.tools import answer_grammar, plan_tools

# What the stored responses may hold, together; past any bound the least recently used go.
MAX_STORED_RESPONSES = 4096
MAX_STORED_TOKENS = 16 * 1024 * 1024  # prompt and output ids (4 bytes each: 64 MiB)
DEFAULT_STORED_BYTES = 256 << 20  # --responses-store-bytes: everything kept, counted as below (`_weight`)
# OpenAI's limits on `metadata`: pairs, and characters of a key and of a value.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


log = logging.getLogger(__name__)


# ---- the request ---------------------------------------------------------------------------------------------
class ContentPart(Fields):
    where: ClassVar[str] = "content[]."
    # An input image: DeepSeek-V4 reads none, so it is `[Unsupported Image]`, as DeepSeek's converter has it.
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text", "input_image"]
    text: str = ""
    image_url: str | None = ignored(IMAGE_IGNORED)
    file_id: str | None = ignored(IMAGE_IGNORED)
    detail: str | None = ignored(IMAGE_IGNORED)
    annotations: list[Any] | None = ignored("a reply field, sent back with earlier output items")
    logprobs: list[Any] | None = ignored("a reply field, sent back with earlier output items")


class _Item(Fields):
    where: ClassVar[str] = "input[]."
    """An input item; earlier output items come back with their id and status, which change nothing."""

    id: str | None = ignored("an earlier output item's id; the item itself is what counts")
    status: str | None = ignored("an earlier output item's status")


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[ContentPart] = []
    content: list[ContentPart] | None = None
    encrypted_content: str | None = ignored("v4serve's reasoning is plain text in `content`")


def _item_kind(item: Any) -> str:
    """An item's type; a message may leave it out (`{"role": "user", "content": "..."}`)."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_kind)]


class FunctionTool(Fields):
    where: ClassVar[str] = "tools[]."
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = ignored("a forced call's arguments always follow the schema (a grammar), whatever it "
                                  "says; under auto calls are parsed, not constrained")


class HostedTool(BaseModel):
    """A tool of another type (`web_search`, `file_search`, `namespace`, `mcp`, `custom`, ...): run by
    OpenAI's servers or by a client protocol this model cannot call into. Dropped from the prompt, with a
    log line; its settings are not read (returned as sent)."""

    model_config = ConfigDict(extra="allow")

    type: str


def _tool_kind(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "function" if kind == "function" else "hosted"


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[HostedTool, Tag("hosted")],
                 Discriminator(_tool_kind)]


class TextFormat(Fields):
    where: ClassVar[str] = "text.format."
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = ignored("V4's prompt format has no place for a format's description")
    strict: bool | None = ignored("the format is always enforced (a grammar), whatever it says")


class TextConfig(Fields):
    where: ClassVar[str] = "text."
    format: TextFormat | None = None
    verbosity: str | None = ignored("V4 has no verbosity setting")


class ReasoningConfig(Fields):
    where: ClassVar[str] = "reasoning."
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra"] | None = None
    summary: str | None = ignored("the reasoning comes back whole, as `content`, never summarised")
    generate_summary: str | None = ignored("the reasoning comes back whole, as `content`, never summarised")


class ResponsesRequest(Fields):
    """OpenAI's request: every field honoured, listed as ignored, or refused (see `Fields` for unknown ones)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA_PAIRS)  # returned with the response
    truncation: Literal["disabled"] | None = None  # "auto" (dropping the conversation's middle) is a 400
    # `true` queues the response for polling; answered at once instead, a client would poll for nothing: a 400.
    background: Literal[False] | None = None
    # v4serve's: how this request writes window-state snapshots for later hits (see --swa-cache-mode).
    swa_cache_mode: Literal["full", "periodic", "zero", "auto"] | None = None
    # vLLM's prefill/decode hand-over, which its router sends each leg (server/handover.py).
    kv_transfer_params: dict[str, Any] | None = None
    include: list[str] | None = ignored("reasoning items always carry their text; nothing is encrypted or "
                                        "held back")
    user: str | None = ignored("an end-user id for the provider's abuse monitoring")
    safety_identifier: str | None = ignored("an end-user id for the provider's abuse monitoring")
    prompt_cache_key: str | None = ignored("a cache-routing hint; the prefix cache needs none")
    service_tier: str | None = ignored("v4serve has one service tier")
    client_metadata: dict[str, Any] | None = ignored("the client's own ids for its logs (Codex sends its session "
                                                     "and turn ids); nothing in the output depends on them")
    stream_options: dict[str, Any] | None = ignored("stream obfuscation pads events against a network "
                                                    "observer; v4serve adds none")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (v or {}).items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY} characters and values at most "
                                 f"{MAX_METADATA_VALUE} (as OpenAI's)")
        return v

    @field_validator("input")
    @classmethod
    def _items(cls, v: str | list[Any]) -> str | list[Any]:
        if isinstance(v, list) and not 1 <= len(v) <= MAX_MESSAGES:
            raise ValueError(f"input must hold 1 to {MAX_MESSAGES} items")
        return v


# ---- stored responses ------------------------------------------------------------------------------------------
@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object, as returned
    owner: str  # a digest of the API key that made it
    messages: list[dict[str, Any]]  # the conversation it answered, the answer last
    settings: tuple[Any, ...]  # what else shaped its prompt: instructions, tools, thinking, effort
    tokens: array = field(default_factory=lambda: array("i"))  # its prompt and output ids
    weight: int = 0  # bytes it is counted as (`_weight`)


def _weight(value: Any) -> int:
    """About the bytes a kept value holds: its strings' lengths and 8 per other leaf or container,
    walked once when it is kept (metadata, tools, input and output all count)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return 8 + sum(len(k) + _weight(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return 8 + sum(_weight(v) for v in value)
    if isinstance(value, array):
        return value.itemsize * len(value)
    return 8


class StoredResponses:
    """Responses by id, least recently used dropped first past MAX_STORED_RESPONSES, MAX_STORED_TOKENS or
    `max_bytes` (`--responses-store-bytes`); a response larger than `max_bytes` alone is not kept."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_tokens: int = MAX_STORED_TOKENS,
                 max_bytes: int = DEFAULT_STORED_BYTES, on_drop: Callable[[str], None] | None = None) -> None:
        """`on_drop`: told the id of each response dropped past the bounds."""
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._tokens, self.max_responses, self.max_tokens = 0, max_responses, max_tokens
        self.bytes, self.max_bytes = 0, max_bytes
        self._on_drop = on_drop

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keep it (False: too large to keep)."""
        stored.weight = _weight([stored.body, stored.messages, stored.settings, stored.tokens])
        if stored.weight > self.max_bytes or len(stored.tokens) > self.max_tokens:
            log.warning("response %s not stored: it weighs %d bytes and %d tokens, more than the store holds "
                        "(--responses-store-bytes %d)", response_id, stored.weight, len(stored.tokens), self.max_bytes)
            return False
        self._items[response_id] = stored
        self._tokens += len(stored.tokens)
        self.bytes += stored.weight
        while self._items and (len(self._items) > self.max_responses or self._tokens > self.max_tokens
                               or self.bytes > self.max_bytes):
            dropped_id, dropped = self._items.popitem(last=False)
            self._forget(dropped)
            if self._on_drop is not None:
                self._on_drop(dropped_id)
        return True

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str, owner: str) -> StoredResponse:
        stored = self._items.get(response_id)
        if stored is None or stored.owner != owner:
            raise not_found(response_id)
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str, owner: str) -> None:
        self.get(response_id, owner)
        self._forget(self._items.pop(response_id))

    def _forget(self, dropped: StoredResponse) -> None:
        self._tokens -= len(dropped.tokens)
        self.bytes -= dropped.weight

    def holds(self, response_id: str) -> bool:
        return response_id in self._items

    def discard(self, response_id: str) -> None:
        """Drop it if kept (no owner check, no error)."""
        dropped = self._items.pop(response_id, None)
        if dropped is not None:
            self._forget(dropped)


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response found with id {echo(response_id)}.", "NotFoundError",
                    param="previous_response_id", code="response_not_found")


_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")  # what `create` names them: nothing else is a file name


class SharedStoredResponses:
    """The stored responses of several API-server processes, one file each in a private folder
    (written under a temporary name, then renamed into place): any process finds what another
    stored, and a delete anywhere is seen everywhere. Each process bounds what it stored itself to
    its share of the bounds (`StoredResponses`, its own least recently stored or read first; a read
    in another process does not count as a use), and removes the files it drops."""

    def __init__(self, folder: str | Path, processes: int, max_bytes: int = DEFAULT_STORED_BYTES) -> None:
        self.folder = Path(folder)
        self.own = StoredResponses(max(1, MAX_STORED_RESPONSES // processes), MAX_STORED_TOKENS // processes,
                                   max_bytes // processes, on_drop=self._remove)

    def _path(self, response_id: str) -> Path | None:
        return self.folder / response_id if _RESPONSE_ID.fullmatch(response_id) else None

    def put(self, response_id: str, stored: StoredResponse) -> None:
        path = self._path(response_id)
        assert path is not None, response_id
        if not self.own.put(response_id, stored):
            return
        fd, temporary = tempfile.mkstemp(dir=self.folder, prefix=".writing-")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(stored, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(temporary, path)

    def get(self, response_id: str, owner: str) -> StoredResponse:
        path = self._path(response_id)
        if path is None:
            raise not_found(response_id)
        if self.own.holds(response_id):
            if not path.exists():  # deleted by another process
                self.own.discard(response_id)
                raise not_found(response_id)
            return self.own.get(response_id, owner)  # a use of its own, no file read
        try:
            # The folder is this daemon's alone (0700, made at start): what is in it, it wrote.
            data = path.read_bytes()
        except FileNotFoundError:
            raise not_found(response_id) from None
        stored: StoredResponse = pickle.loads(data)  # noqa: S301 - see above
        if stored.owner != owner:
            raise not_found(response_id)
        return stored

    def delete(self, response_id: str, owner: str) -> None:
        self.get(response_id, owner)
        self.own.discard(response_id)
        self._remove(response_id)

    def _remove(self, response_id: str) -> None:
        path = self._path(response_id)
        if path is not None:
            path.unlink(missing_ok=True)


ResponseStore = StoredResponses | SharedStoredResponses


def owner_of(raw: Request) -> str:
    """Whom a stored response belongs to: the caller the key check decided on (`tenants.caller`)."""
    return CURRENT_CALLER.get().owner


# ---- items → conversation --------------------------------------------------------------------------------------
def _text(content: str | list[ContentPart]) -> str:
    """Parts' text as DeepSeek's converter joins it: a blank line between parts."""
    if isinstance(content, str):
        return content
    return "\n\n".join(UNSUPPORTED_IMAGE if p.type == "input_image" else p.text for p in content)


def _user_content(content: str | list[ContentPart]) -> str | list[dict[str, Any]]:
    """A user message's parts as chat parts (the prompt format decides how an image is written)."""
    if isinstance(content, str):
        return content
    image = {"type": "image_url", "image_url": {"url": ""}}
    return [image if p.type == "input_image" else {"type": "text", "text": p.text} for p in content]


def conversation(items: str | list[Any], developer: str = "user") -> list[dict[str, Any]]:
    """Input items as the chat endpoint's messages: calls and reasoning join the assistant turn they
    belong to, call outputs become tool messages, a developer item is a `developer` message (the user's for
    V4, a system message for V4.1, as DeepSeek's converter reads Responses)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []

    def assistant() -> dict[str, Any]:
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for item in items:
        if isinstance(item, MessageItem) and item.role == "assistant":
            assistant()["content"] += _text(item.content)
        elif isinstance(item, MessageItem):
            role = developer if item.role == "developer" else item.role
            content = _user_content(item.content) if role == "user" else _text(item.content)
            out.append({"role": role, "content": content})
        elif isinstance(item, ReasoningItem):
            turn = assistant()
            turn["reasoning_content"] = turn.get("reasoning_content", "") + _text(item.content or item.summary)
        elif isinstance(item, FunctionCallItem):
            assistant().setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return out


def _answer_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant turn of the conversation."""
    items = [_item(i) for i in output]
    (turn,) = conversation(items) or [{"role": "assistant", "content": ""}]
    return turn


def _item(item: dict[str, Any]) -> Any:
    kind = item["type"]
    if kind == "message":
        return MessageItem(role="assistant", content=[ContentPart(type="output_text", text=p["text"])
                                                      for p in item["content"]])
    if kind == "reasoning":
        return ReasoningItem(type="reasoning", content=[ContentPart(type="reasoning_text", text=p["text"])
                                                        for p in item["content"]])
    return FunctionCallItem(type="function_call", call_id=item["call_id"], name=item["name"],
                            arguments=item["arguments"])


# ---- the endpoint ----------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    """One request, ready to run."""

    response_id: str
    model: str
    generation: Generation
    messages: list[dict[str, Any]]
    settings: tuple[Any, ...]
    prompt: list[int]
    previous: str | None
    thinking: bool


async def create(front: FrontEnd, stored: ResponseStore, body: ResponsesRequest, raw: Request) -> Response:
    plan = await _plan(front, stored, body, raw)
    if body.stream:
        events, opening = _Events(), _response(body, plan, [], None, None)
        stream = _stream(front, stored, body, plan, owner_of(raw), events, opening)
        return EventStream(stream, pacing=Pacing(front.config.stream_keepalive,
                                                 lambda: events("response.in_progress", response=opening),
                                                 plan.generation.wake))
    (deltas,) = await front.collect(plan.generation, raw)
    response = _response(body, plan, _output(deltas, plan.thinking), deltas[-1], plan.generation.usage())
    _keep(stored, body, plan, response, deltas, owner_of(raw), front.tokenizer.eos_token_id)
    return JSONResponse({**response, **plan.generation.transfer_reply()})


async def _plan(front: FrontEnd, stored: ResponseStore, body: ResponsesRequest, raw: Request) -> _Plan:
    model = front.check_model(body.model)
    thinking = _thinking(body, front.config.default_thinking)
    earlier = None
    if body.previous_response_id is not None:
        found = stored.get(body.previous_response_id, owner_of(raw))
        earlier = (found.messages, found.settings, found.tokens)
    ready, messages, settings = await front.prep.run(prepared, await raw.body(), front.think_end_id,
                                                     front.config.max_model_len, earlier,
                                                     front.config.unknown_fields, front.config.default_thinking)
    prompt = ready.prompt.tolist()
    fields = SamplingFields(temperature=body.temperature, top_p=body.top_p, swa_cache_mode=body.swa_cache_mode,
                            stream=body.stream, kv_transfer_params=body.kv_transfer_params)
    max_tokens = front.default_max_tokens(body.max_output_tokens, len(prompt))
    output = front.output_options(fields, reasoning_end_token=front.think_end_id if thinking else None,
                                  tool_calls=ready.parse_calls, parallel_tool_calls=ready.parallel,
                                  inside_tool_calls=ready.inside_calls)
    response_id = f"resp_{uuid.uuid4().hex}"
    generation = front.generation(response_id, prompt, fields, max_tokens, None, output, grammar=ready.grammar)
    await front.check([generation], raw)
    return _Plan(response_id, model, generation, messages, settings, prompt, body.previous_response_id, thinking)


def _thinking(body: ResponsesRequest, default: bool) -> bool:
    """`reasoning.effort` "none" answers in chat mode, any other effort thinks, none given `default`."""
    if body.reasoning is None or body.reasoning.effort is None:
        return default
    return body.reasoning.effort != "none"


# ---- preprocessing (a job for `preprocess.Preprocessor`: the body's bytes in, parsed again there) -------------
Earlier = tuple[list[dict[str, Any]], tuple[Any, ...], array]  # a stored response's conversation, settings, ids


def prepared(tokenizer: Any, data: bytes, think_end_id: int | None, max_len: int, earlier: Earlier | None,
             unknown_fields: str, default_thinking: bool
             ) -> tuple[jobs.Prepared, list[dict[str, Any]], tuple[Any, ...]]:
    """(the prompt with its tools and grammar, the conversation to store, the settings that shaped it):
    a follow-up of a stored response with the same settings continues its tokens; anything else is
    rendered whole."""
    body = ResponsesRequest.model_validate_json(data, strict=True, context=validation_context(unknown_fields))
    thinking = _thinking(body, default_thinking)
    effort = effort_level(body.reasoning.effort if body.reasoning else None) if thinking else None
    for tool in body.tools or []:
        if isinstance(tool, HostedTool):
            note_once(f"responses-tool-{tool.type[:64]}", "dropped a Responses tool of type %r from the prompt: the "
                      "model can call only function tools", tool.type[:64])
    functions = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.parameters or {"type": "object", "properties": {}}}}
                 for t in body.tools or [] if isinstance(t, FunctionTool)]
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    tools = plan_tools(functions or None, choice, body.parallel_tool_calls)
    fmt = body.text.format if body.text else None
    response_format = None if fmt is None or fmt.type == "text" else \
        {"type": "json_object"} if fmt.type == "json_object" else \
        {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_ or {}}}
    prefill = jobs.prefills_call(tools, {"thinking": thinking})
    grammar = answer_grammar(tools, response_format, think_end_id if thinking else None, prefill)
    settings = (body.instructions, json.dumps(functions), thinking, effort, json.dumps(response_format), prefill)
    options = {"thinking": thinking, "tools": tools.offered, "reasoning_effort": effort,
               "response_format": response_format, "call_prefill": prefill}
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    new = conversation(body.input, "system" if prompt_format_of(tokenizer).system_marker else "user")
    messages = new if earlier is None else earlier[0] + new
    prompt = None
    if earlier is not None and earlier[1] == settings:
        prompt = jobs.continuation(tokenizer, system + earlier[0], new, earlier[2], max_len, **options)
    if prompt is None:
        prompt = jobs.encode_chat(tokenizer, system + messages, max_len, "input", **options)
    return jobs.Prepared(prompt, tools.parse_calls, tools.parallel, grammar, prefill), messages, settings


def _keep(stored: ResponseStore, body: ResponsesRequest, plan: _Plan, response: dict[str, Any],
          deltas: list[Delta], owner: str, eos: int | None) -> None:
    if not body.store:
        return
    output = [t for d in deltas for t in d.token_ids]
    if eos is not None and output[-1:] != [eos]:  # cut off, or ended by a stop: the turn still ends
        output.append(eos)
    tokens = array("i", plan.prompt + output)
    stored.put(plan.response_id, StoredResponse(response, owner, plan.messages + [_answer_message(response["output"])],
                                                plan.settings, tokens))


# ---- the response --------------------------------------------------------------------------------------------
def _output(deltas: list[Delta], thinking: bool) -> list[dict[str, Any]]:
    reasoning = "".join(d.reasoning for d in deltas)
    text = "".join(d.text for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in (c for delta in deltas for c in delta.tool_calls):
        call = calls.setdefault(d.index, {"call_id": d.id, "name": d.name, "arguments": ""})
        call["arguments"] += d.arguments
    complete = deltas[-1].finish_reason != "length"
    items: list[dict[str, Any]] = []
    if thinking and reasoning:
        items.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", reasoning))
    if text:
        items.append(_message_item(f"msg_{uuid.uuid4().hex}", text, "completed" if complete else "incomplete"))
    for i, c in sorted(calls.items()):
        last = i == max(calls)
        items.append(_call_item(f"fc_{uuid.uuid4().hex}", c["call_id"], c["name"], c["arguments"],
                                "completed" if complete or not last else "incomplete"))
    return items


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _usage(usage: PromptUsage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _response(body: ResponsesRequest, plan: _Plan, output: list[dict[str, Any]], last: Delta | None,
              usage: PromptUsage | None) -> dict[str, Any]:
    """The response object: in progress while `last` is None, then completed or incomplete."""
    status = "in_progress" if last is None else "incomplete" if last.finish_reason == "length" else "completed"
    return {
        "id": plan.response_id, "object": "response", "created_at": int(time.time()), "status": status,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": plan.model, "output": output, "instructions": body.instructions,
        "tools": [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools or []],
        "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
        "previous_response_id": plan.previous, "reasoning": body.reasoning.model_dump() if body.reasoning else None,
        "text": body.text.model_dump(by_alias=True) if body.text else {"format": {"type": "text"}},
        "truncation": "disabled", "background": False, "store": body.store, "metadata": body.metadata or {},
        "usage": _usage(usage) if usage is not None else None,
    }


# ---- the stream ------------------------------------------------------------------------------------------------
class _Events:
    """Typed events, numbered in order; the open output item (reasoning, message or a call) and its text."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: Any = None  # "reasoning", "message" or ("call", index)

    def __call__(self, kind: str, **payload: Any) -> str:
        self.sequence += 1
        return typed_event(kind, {"sequence_number": self.sequence - 1, **payload})

    @property
    def index(self) -> int:
        return len(self.items) - 1

    def start(self, key: Any, item: dict[str, Any]) -> list[str]:
        if self.open == key:
            return []
        out = self.finish()
        self.items.append(item)
        self.open = key
        out.append(self("response.output_item.added", output_index=self.index, item=_opening(item)))
        if item["type"] == "message":
            out.append(self("response.content_part.added", item_id=item["id"], output_index=self.index,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def finish(self, status: str = "completed") -> list[str]:
        if self.open is None:
            return []
        self.open = None
        item, i = self.items[-1], self.index
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            item["status"] = status
            out += [self("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                         text=part["text"], logprobs=[]),
                    self("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)]
        elif item["type"] == "reasoning":
            out.append(self("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                            text=item["content"][0]["text"]))
        else:
            item["status"] = status
            out.append(self("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                            name=item["name"], arguments=item["arguments"]))
        out.append(self("response.output_item.done", output_index=i, item=item))
        return out


def _opening(item: dict[str, Any]) -> dict[str, Any]:
    """An item as `output_item.added` shows it: nothing written yet."""
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    if item["type"] == "reasoning":
        return {**item, "content": []}
    return {**item, "arguments": "", "status": "in_progress"}


def _pieces(events: _Events, delta: Delta) -> list[str]:
    out: list[str] = []
    if delta.reasoning:
        out += events.start("reasoning", _reasoning_item(f"rs_{uuid.uuid4().hex}", ""))
        events.items[-1]["content"][0]["text"] += delta.reasoning
        out.append(events("response.reasoning_text.delta", item_id=events.items[-1]["id"],
                          output_index=events.index, content_index=0, delta=delta.reasoning))
    if delta.text:
        out += events.start("message", _message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress"))
        events.items[-1]["content"][0]["text"] += delta.text
        out.append(events("response.output_text.delta", item_id=events.items[-1]["id"], output_index=events.index,
                          content_index=0, delta=delta.text, logprobs=[]))
    for call in delta.tool_calls:
        if call.id is not None:
            out += events.start(("call", call.index), _call_item(f"fc_{uuid.uuid4().hex}", call.id, call.name or "",
                                                                 "", "in_progress"))
        if call.arguments:
            events.items[-1]["arguments"] += call.arguments
            out.append(events("response.function_call_arguments.delta", item_id=events.items[-1]["id"],
                              output_index=events.index, delta=call.arguments))
    return out


async def _stream(front: FrontEnd, stored: ResponseStore, body: ResponsesRequest, plan: _Plan,
                  owner: str, events: _Events, opening: dict[str, Any]) -> AsyncIterator[str]:
    yield events("response.created", response=opening)
    yield events("response.in_progress", response=opening)
    deltas: list[Delta] = []
    try:
        async with contextlib.aclosing(plan.generation.deltas()) as stream:
            async for delta in stream:
                if delta is WAKE:
                    yield KEEPALIVE
                    continue
                if delta.error:
                    failed = {**opening, "status": "failed", "output": events.items,
                              "error": {"code": "invalid_prompt" if delta.error_param else "server_error",
                                        "message": delta.error}}
                    yield events("response.failed", response=failed)
                    return
                deltas.append(delta)
                for piece in _pieces(events, delta):
                    yield piece
    except Exception as exc:  # after the first byte an error can only be an event
        yield events("error", code="server_error", param=None,
                     message=f"the stream failed: {failure_message(exc, 'a stream failed')}")
        return
    last = deltas[-1]
    for piece in events.finish("incomplete" if last.finish_reason == "length" else "completed"):
        yield piece
    response = _response(body, plan, events.items, last, plan.generation.usage())
    _keep(stored, body, plan, response, deltas, owner, front.tokenizer.eos_token_id)
    yield events("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                 response=response)
