"""OpenAI request models (pydantic, at the HTTP boundary only)."""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

CHAT_TEMPLATE_KWARGS = frozenset({"thinking", "enable_thinking"})
MAX_STOPS = 16
# The detokenizer holds back every prefix of every stop string: this bounds what one request costs.
MAX_STOP_CHARS = 256
_TOKEN_ID = re.compile(r"-?[0-9]+")
# Every list a request carries has a bound, checked while the body is validated (before any
# tokenizing, id scanning or grammar compiling); README lists them.
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
MAX_PROMPTS = 64  # completions: prompts in one request (× n, at most MAX_CHOICES choices)
MAX_TOOLS = 128  # as OpenAI's API
MAX_MESSAGES = 4096


IGNORED = "x-v4serve-ignored"  # schema marker of fields accepted for compatibility and ignored
UNKNOWN_FIELD = "unknown_field"  # the pydantic error type of a field no model defines (--unknown-fields refuse)
# Distinct unknown field names logged per process (each once): a client cannot fill the log.
MAX_LOGGED_UNKNOWN = 256

log = logging.getLogger(__name__)
_logged_unknown: set[str] = set()


class Fields(BaseModel):
    """Every request model's base. A field no model defines is, by `--unknown-fields`: dropped (the
    default: named in the validation context's `ignored` list, for the reply's header, and logged once
    per name), or refused as a 400 naming it. Clients ship new fields monthly and nearly all of them are
    metadata; the fields whose meaning v4serve knows are honoured, listed as ignored, or refused by value.
    Validated without a context (internal use), an unknown field is refused."""

    model_config = ConfigDict(extra="allow")
    where: ClassVar[str] = ""  # the model's place in a body, as a prefix of its fields' names

    @model_validator(mode="after")
    def _unknown(self, info: ValidationInfo) -> Any:
        for name in _ignored_fields(type(self)) & self.model_fields_set:
            note_once(f"ignored-{self.where}{name}", "accepted and ignored the request field %r: %s", self.where + name,
                      _ignored_reason(type(self), name), level=logging.DEBUG)
        extra = self.__pydantic_extra__
        if not extra:
            return self
        context = info.context if isinstance(info.context, dict) else {}
        name = next(iter(extra))
        if context.get("unknown_fields") != "accept":
            raise PydanticCustomError(UNKNOWN_FIELD, "Extra inputs are not permitted (unknown field)",
                                      {"field": name[:64]})
        ignored_names = context.setdefault("ignored", [])
        for field in extra:
            noted = self.where + field[:64]
            if noted not in ignored_names and len(ignored_names) < 16:
                ignored_names.append(noted)
            note_once(f"unknown-{noted}", "ignored the unknown request field %r (%s; --unknown-fields refuse makes "
                      "it a 400)", noted, type(self).__name__, level=logging.WARNING)
        extra.clear()
        return self


@functools.cache
def _ignored_fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(n for n, f in model.model_fields.items() if IGNORED in (f.json_schema_extra or {}))


def _ignored_reason(model: type[BaseModel], name: str) -> str:
    extra = model.model_fields[name].json_schema_extra
    return str(extra[IGNORED]) if isinstance(extra, dict) else ""


def note_once(key: str, message: str, *args: Any, level: int = logging.INFO) -> None:
    """Log `message` the first time `key` is seen in this process (bounded: a client cannot fill the log)."""
    if key not in _logged_unknown and len(_logged_unknown) < MAX_LOGGED_UNKNOWN:
        _logged_unknown.add(key)
        log.log(level, message, *args)


def validation_context(unknown_fields: str) -> dict[str, Any]:
    """The context a body is validated in: the policy, and where the names of dropped fields go."""
    return {"unknown_fields": unknown_fields, "ignored": []}


IMAGE_IGNORED = ("DeepSeek-V4 reads no images: an image is written as [Unsupported Image], as DeepSeek's converter "
                 "writes it")


def ignored(reason: str, default: Any = None) -> Any:
    """A field accepted for compatibility and ignored; the README's list gives the same reason."""
    return Field(default, description=f"Accepted and ignored: {reason}", json_schema_extra={IGNORED: reason})


# Router extras accepted only at the value that asks for what v4serve does anyway: field → (that value, why).
ONLY_AT = {
    "return_hidden_states": (False, "v4serve does not return hidden states"),
    "continue_final_message": (False, "v4serve does not continue a final assistant message"),
    "separate_reasoning": (True, "v4serve always returns reasoning apart from the answer, as it is made "
                                 "(reasoning_content; include_reasoning: false leaves it out)"),
    "stream_reasoning": (True, "v4serve always returns reasoning apart from the answer, as it is made "
                               "(reasoning_content; include_reasoning: false leaves it out)"),
}


def only_at(cls: type, value: bool, info: ValidationInfo) -> bool:
    """A field validator for ONLY_AT's fields: the value v4serve honours, or a 400 naming the field."""
    expected, why = ONLY_AT[str(info.field_name)]
    if value != expected:
        raise ValueError(f"{why}; only {str(expected).lower()} is accepted")
    return value


class ThinkingSwitch(Fields):
    """DeepSeek's API shape of the thinking switch: `{"type": "enabled" | "disabled"}`."""

    type: Literal["enabled", "disabled"]


class StreamOptions(Fields):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(Fields):
    """Fields shared by both endpoints. Nothing is silently dropped: a field is honoured, listed as
    accepted-and-ignored (with the reason, also in the README), or a 400."""

    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # Below 0.01 a penalty scales logits past what float32 holds.
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    # How this request writes window-state snapshots for later hits (None: the daemon's --swa-cache-mode).
    swa_cache_mode: Literal["full", "periodic", "zero", "auto"] | None = None
    # vLLM's prefill/decode hand-over (server/handover.py): what its router sends each leg; SGLang's router
    # sends both legs the same request at once, naming the prefill replica and a room number.
    kv_transfer_params: dict[str, Any] | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = Field(None, gt=0, lt=65536)
    bootstrap_room: int | None = Field(None, ge=0, lt=2**64)
    user: str | None = ignored("an end-user id for the provider's abuse monitoring; v4serve keeps no such records")
    # SGLang's extras, which vLLM's and SGLang's routers forward at their defaults: honoured, or refused
    # (naming the field) when a value asks for what v4serve does not do.
    no_stop_trim: bool = False  # keep the stop string in the output: include_stop_str_in_output
    return_hidden_states: bool = False

    _hidden_states = field_validator("return_hidden_states")(only_at)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not _TOKEN_ID.fullmatch(key):  # ASCII digits: str.isdigit() also takes "²", which int() refuses
                raise ValueError(f"logit_bias keys must be token ids, got {repr(key)[:64]}")
            if not -100 <= value <= 100:
                raise ValueError("logit_bias values must be between -100 and 100")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatMessage(Fields):
    where: ClassVar[str] = "messages[]."
    role: Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    prefix: bool | None = None  # DeepSeek's chat prefix completion: the last assistant message, continued
    name: str | None = ignored("DeepSeek-V4's prompt format has no participant names")
    # What the SDK sends back when a reply's message object is appended to the conversation:
    refusal: str | None = ignored("a reply field, sent back with earlier assistant messages")
    annotations: list[Any] | None = ignored("a reply field, sent back with earlier assistant messages")
    audio: None = ignored("a reply field; only null is accepted (no audio)")
    function_call: None = ignored("the deprecated form of tool_calls; only null is accepted")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra"] | None = None
    thinking: bool | ThinkingSwitch | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    modalities: list[Literal["text"]] | None = ignored('text is the only output; anything but ["text"] is a 400')
    metadata: dict[str, str] | None = ignored("for stored completions; v4serve stores none")
    store: bool | None = ignored("v4serve stores no completions")
    service_tier: str | None = ignored("v4serve has one service tier")
    prompt_cache_key: str | None = ignored("a cache-routing hint; v4serve's prefix cache needs none "
                                           "(use cache_salt to separate tenants)")
    safety_identifier: str | None = ignored("an end-user id for the provider's abuse monitoring")
    prediction: dict[str, Any] | None = ignored("predicted outputs only speed generation up; "
                                                "outputs are the same without them")
    # vLLM's and SGLang's chat extras (routers forward them at these defaults).
    include_reasoning: bool = True  # false leaves reasoning_content out of the reply
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    _only_at = field_validator("continue_final_message", "separate_reasoning", "stream_reasoning")(only_at)

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        unknown = sorted(set(v or {}) - CHAT_TEMPLATE_KWARGS)
        if unknown:  # DeepSeek-V4 has no Jinja template: only these switches mean anything
            raise ValueError(f"unsupported chat_template_kwargs {unknown}; supported: {sorted(CHAT_TEMPLATE_KWARGS)}")
        return v

    def thinking_mode(self, default: bool = True) -> bool:
        """V4's thinking mode, decided as DeepSeek's converter decides it: DeepSeek's `thinking` switch (or
        a boolean) first, then `reasoning_effort: "none"` (off), then vLLM's `chat_template_kwargs`
        switches, then any other effort (on), else `default` (the daemon's: `--default-chat-template-kwargs`,
        or the model's)."""
        if isinstance(self.thinking, ThinkingSwitch):
            return self.thinking.type == "enabled"
        if self.thinking is not None:
            return self.thinking
        if self.reasoning_effort == "none":
            return False
        # An effort asks for reasoning (an OpenAI SDK user's `reasoning_effort="high"`), whatever the default.
        return template_thinking(self.chat_template_kwargs, default or self.reasoning_effort is not None)

    def v4_effort(self) -> str | None:
        return effort_level(self.reasoning_effort)


def template_thinking(kwargs: dict[str, Any] | None, default: bool) -> bool:
    """The thinking switch of chat-template kwargs (`thinking`, or `enable_thinking`), else `default`."""
    kwargs = kwargs or {}
    for name in ("thinking", "enable_thinking"):
        if name in kwargs:
            return bool(kwargs[name])
    return default


def effort_level(effort: str | None) -> str:
    """A request's reasoning effort on the encoding's three levels, as DeepSeek's converter maps OpenAI's
    and DeepSeek's values: none given (or "none" with thinking on) is its default, high; minimal and low
    think with no instruction; medium, high and xhigh get the high instruction; max and ultra max's."""
    if effort in ("minimal", "low"):
        return "low"
    return "max" if effort in ("max", "ultra") else "high"


class CompletionRequest(SamplingFields):
    # Token ids first: pydantic tries members in order, and a long id list is the costly case.
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], (str, list)) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported by this model")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (or be omitted)")
        return self


class TokenizeRequest(Fields):
    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"prompt": "Hello, world"},
        {"messages": [{"role": "user", "content": "Hello"}]},
        {"prompt": "no BOS", "add_special_tokens": False}]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(Fields):
    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [{"tokens": [72, 101, 108, 108, 111]}]})

    model: str | None = None
    tokens: list[int]
