"""DeepSeek-V4 prompt encoding: OpenAI-style messages → the prompt string the model was trained on.

The format is DeepSeek's own V4 encoding, as its request converter (`deepseek-recipe`, the oracle of
tests/test_encoding_oracle.py) renders it; there is no Jinja chat template. A conversation renders as::

    BOS{effort}{system}<｜User｜>{user}<｜Assistant｜></think>{answer}EOS<｜User｜>{user}<｜Assistant｜></think>

- **The head**: every system message's text, wherever it stands in the conversation, joined by a blank
  line and put after BOS (no role marker); then the tool instructions (a fixed "## Tools" block with each
  tool's schema) and the response format (a fixed "## Response Format" block), each after a blank line.
  In thinking mode the reasoning effort's fixed instruction comes first (`EFFORT_PREFIXES`).
- **User turns**: ``tool`` messages and the ``user`` messages around them merge into one user turn whose
  parts are joined by a blank line, each tool result wrapped in ``<tool_result>…</tool_result>`` and
  ordered like the calls that produced it; an image is ``[Unsupported Image]`` (V4 reads no images).
- **Assistant turns** open with ``<｜Assistant｜>`` and ``</think>`` (chat mode, or reasoning dropped) or
  ``<think>{reasoning}</think>`` (kept), then the answer, the tool calls in DSML after a blank line, and
  EOS. In thinking mode reasoning is dropped from every assistant turn of the request unless tools are
  declared (then every turn keeps it, so thinking with tools stays prefix-stable turn after turn); a
  conversation rendered without a generation prompt keeps it after the last user turn.
- **The generation prompt** ``<｜Assistant｜>`` + ``<think>`` (thinking) or ``</think>`` always ends the
  prompt, after whatever the last message is, unless that message is an assistant's with ``prefix``
  (DeepSeek's chat prefix completion): that one stays open, no EOS, and the model continues it. Under a
  required or named ``tool_choice`` (chat mode) the tool-call block is opened after it (``CALL_PREFILL``)
  and only the named tool is offered.
- ``latest_reminder`` is a marker of its own, in place; ``developer`` renders like a user turn carrying
  its own instructions (and, in thinking mode, one before the last user turn is dropped).

v4serve's own choices where the converter has none: ``add_generation_prompt=False`` leaves the
generation prompt out (a stored response's rendering, continued token for token); ``drop_thinking=False``
keeps every turn's reasoning; ``developer`` messages (which the converter refuses) are rendered.

DeepSeek-V4.1's format (`V41`, for a `deepseek_v41` checkpoint; tests/test_encoding_oracle_v41.py) is the same
but for `PromptFormat`'s fields: ``<｜System｜>`` opens the first system message (the effort, as a number, and
the tools go there) and marks each later one in place; DSML tags take a space (``<｜DSML｜ calls>``); an image
is the ``<｜image｜>`` token; json_object is written as a schema.

The specials the encoding writes are `Special` pieces: `RenderedPrompt.special_ranges` says where they are,
and a tokenizer encodes everything else as text, so a client's literal never becomes a control token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from v4serve.server.text.tokenizer import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    IMAGE,
    LATEST_REMINDER,
    SYSTEM,
    THINK_END,
    THINK_START,
    USER,
)

SUPPORTED_ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
# The converter's three levels: a request's effort (OpenAI's, DeepSeek's, Anthropic's) maps onto one of
# these (`protocol.effort_level`); None is thinking without an instruction.
EFFORT_LEVELS = ("low", "high", "max")
UNSUPPORTED_IMAGE = "[Unsupported Image]"

# Fixed prompt text the model was trained with; it must match byte for byte.
EFFORT_PREFIXES = {
    "high": (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
        "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
        "and adversarial scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate step, "
        "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
        "unchecked.\n\n"
    ),
    "max": (
        "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
        "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
        "decompose the problem into its most fundamental components, trace every causal chain to its root, "
        "and resolve the underlying cause rather than any surface symptom.\n"
        "Do not stop reasoning until you have independently verified the solution from multiple angles and "
        "are certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
    ),
}

_TOOLS_HEADER = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by "
    f'writing a "<{DSML}tool_calls>" block like the following:\n\n'
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete "
    f"reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_FOOTER = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
_RESPONSE_FORMAT_HEADER = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)
_JSON_OBJECT_FORMAT = (
    "You are a helpful assistant designed to output JSON.\n## Response Format:\n\nReply with JSON object ONLY."
)

_TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
CALL_PREFILL = f"\n\n{_TOOL_CALLS_OPEN}\n"  # what a forced call's prompt ends with; its reply starts inside
_V41_EFFORT = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


@dataclass(frozen=True)
class PromptFormat:
    """Where DeepSeek-V4.1's prompt format differs from V4's (the rest is shared): how system messages are
    marked, how DSML tags are spelled, how effort, json_object and images are written."""

    name: str
    system_marker: bool  # V4.1: `<｜System｜>` opens each system message in place; V4 merges them into the head
    tag_space: str  # between `｜DSML｜` and a tag's name
    block: str  # the tool-call block's tag name
    blank_empty_invoke: bool  # an invoke without arguments holds an empty line
    json_object_as_schema: bool  # json_object written as the schema `{"type": "json_object"}`
    image_text: str | None  # an image part as this text, or None: the image placeholder token

    def tag(self, name: str) -> str:
        return f"{DSML}{self.tag_space}{name}"

    def effort(self, level: str | None) -> str:
        if not self.system_marker:
            return EFFORT_PREFIXES.get(level or "", "")
        return _V41_EFFORT.format({"low": 50, "max": 100}.get(level or "", 75))

    def call_prefill(self) -> str:
        return f"\n\n<{self.tag(self.block)}>\n"

    def tools_header(self) -> str:
        return (_TOOLS_HEADER.replace(f"{DSML}tool_calls", self.tag(self.block))
                .replace(f"{DSML}invoke", self.tag("invoke")).replace(f"{DSML}parameter", self.tag("parameter")))


V4 = PromptFormat("deepseek_v4", system_marker=False, tag_space="", block="tool_calls", blank_empty_invoke=False,
                  json_object_as_schema=False, image_text=UNSUPPORTED_IMAGE)
def prompt_format_of(tokenizer: Any) -> PromptFormat:
    """The checkpoint's prompt format: V4.1's for a `deepseek_v41` model, else V4's."""
    return V41 if tokenizer.model_type == "deepseek_v41" else V4


def missing_specials(tokenizer: Any, fmt: PromptFormat) -> tuple[list[str], list[str]]:
    """The special tokens `fmt` writes that `tokenizer` has no single id for: those every prompt holds (a daemon
    refuses to start without them), then those only some prompts hold (tool calls, a latest_reminder, an image:
    written as their characters, with a warning at start)."""
    always = [BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, *([SYSTEM] if fmt.system_marker else [])]
    some = [DSML, LATEST_REMINDER, *([IMAGE] if fmt.system_marker else [])]
    return ([t for t in always if tokenizer.token_to_id(t) is None],
            [t for t in some if tokenizer.token_to_id(t) is None])


V41 = PromptFormat("deepseek_v41", system_marker=True, tag_space=" ", block="calls", blank_empty_invoke=True,
                   json_object_as_schema=True, image_text=None)


@dataclass
class _Turn:
    """One message after validation; user turns carry their merged parts."""

    role: str
    text: str = ""
    reasoning: str | None = None
    tool_calls: list[Mapping[str, Any]] = field(default_factory=list)
    tools: list[Any] | None = None
    response_format: Any = None
    prefix: bool = False  # an assistant message the model continues (DeepSeek's chat prefix completion)
    # user turns: (kind, text, tool_call_id) with kind "text" or "tool_result"
    parts: list[tuple[str, str, str]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


class Special(str):
    """A special token's literal the encoding writes as markup. It is tokenized as that token; the same
    characters in a message (text a client sent) are tokenized as text."""


_SPECIALS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, DSML, LATEST_REMINDER, SYSTEM, IMAGE)
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in sorted(_SPECIALS, key=len, reverse=True)))
Pieces = list[str]  # text, with the encoding's own special tokens as `Special` pieces


def _markup(fixed: str) -> Pieces:
    """Fixed prompt text of the format's own (instructions, DSML markup) split at the specials it spells."""
    out: Pieces = []
    pos = 0
    for match in _SPECIAL_RE.finditer(fixed):
        out += [fixed[pos:match.start()], Special(match.group())]
        pos = match.end()
    return [*out, fixed[pos:]]



@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt's text and where in it the encoding wrote special tokens (character offsets, as DeepSeek's
    converter reports them): text outside those ranges is tokenized as text, literals included."""

    text: str
    special_ranges: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, pieces: Pieces) -> RenderedPrompt:
        ranges, pos = [], 0
        for piece in pieces:
            if isinstance(piece, Special):
                ranges.append((pos, pos + len(piece)))
            pos += len(piece)
        return cls("".join(pieces), tuple(ranges))

    def extends(self, earlier: RenderedPrompt) -> bool:
        """Whether this prompt is `earlier` with more after it, its specials where they were."""
        n, cut = len(earlier.special_ranges), len(earlier.text)
        return (self.text.startswith(earlier.text) and self.special_ranges[:n] == earlier.special_ranges
                and all(a >= cut for a, _ in self.special_ranges[n:]))

    def after(self, start: int) -> RenderedPrompt:
        """The part from character `start` on (a continuation; `start` must not cut a special)."""
        return RenderedPrompt(self.text[start:], tuple((a - start, b - start) for a, b in self.special_ranges
                                                       if a >= start))


def encode_messages(messages: Sequence[Mapping[str, Any]], thinking: bool = False,
                    add_generation_prompt: bool = True, **options: Any) -> str:
    """The prompt string of `render_messages` (its text alone)."""
    return render_messages(messages, thinking, add_generation_prompt, **options).text


def render_messages(
    messages: Sequence[Mapping[str, Any]],
    thinking: bool = False,
    add_generation_prompt: bool = True,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_effort: str | None = None,
    drop_thinking: bool = True,
    response_format: Mapping[str, Any] | None = None,
    call_prefill: bool = False,
    prompt_format: PromptFormat = V4,
) -> RenderedPrompt:
    """Render OpenAI-style ``messages`` as a DeepSeek-V4 prompt (BOS included).

    `reasoning_effort`: one of EFFORT_LEVELS or None (thinking mode only); `response_format`: the
    request's (OpenAI's shape: text, json_object, json_schema); `call_prefill`: a call is forced (a
    required or named `tool_choice`, chat mode): the prompt opens the tool-call block after the generation
    prompt, as DeepSeek's converter writes it, and the model continues inside it; `prompt_format`: V4's or
    V4.1's (`PromptFormat`, chosen by the checkpoint). Raises ``ValueError`` for
    anything the format cannot express (unknown roles, malformed tool calls, unsupported content parts), so
    a server can answer 400.
    """
    if reasoning_effort is not None and reasoning_effort not in EFFORT_LEVELS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(EFFORT_LEVELS)}; got "
                         f"{repr(reasoning_effort)[:64]}")
    turns = _merge_user_turns([_parse_message(i, m) for i, m in enumerate(messages)])
    if not turns and not tools:
        raise ValueError("messages must not be empty")
    fmt = prompt_format
    head = _head(turns, tools, response_format, messages, fmt)
    # V4 gathers every system message into the head; V4.1 the first one only, the others marked in place.
    body = [t for i, t in enumerate(turns) if t.role != "system" or (fmt.system_marker and i > 0)]
    for t in body:
        if t.prefix and t is not body[-1]:
            raise ValueError("only the last message may be an assistant prefix (prefix: true)")
    has_tools = bool(head.tools) or any(t.tools for t in body)
    drop = thinking and drop_thinking and not has_tools
    if drop:
        body = _drop_old_developers(body)
    effort = fmt.effort(reasoning_effort) if thinking else ""
    # A conversation rendered as it stands (no generation prompt: a stored response, continued) keeps the
    # reasoning of the turns after its last user turn, as DeepSeek's encoding renders a finished exchange.
    last_user = max((i for i, t in enumerate(body) if t.role in ("user", "developer")), default=-1)
    system: Pieces = [effort, head.text, *_instructions(head, fmt)]
    if fmt.system_marker:
        system = [Special(SYSTEM), *system] if any(system) else []
    out: Pieces = [Special(BOS), *system]
    for i, t in enumerate(body):
        with_reasoning = thinking and (not drop or t.prefix or (not add_generation_prompt and i > last_user))
        out += _render_turn(t, with_reasoning, fmt)
    if add_generation_prompt and not (body and body[-1].prefix):
        out += [Special(ASSISTANT), Special(THINK_START if thinking else THINK_END)]
        if call_prefill:
            out += _markup(fmt.call_prefill())
    return RenderedPrompt.of(out)


def _head(turns: list[_Turn], tools: Sequence[Mapping[str, Any]] | None, response_format: Mapping[str, Any] | None,
          messages: Sequence[Mapping[str, Any]], fmt: PromptFormat) -> _Turn:
    """Every system message's text (a blank line between; V4.1: the first message's, if a system one), their
    tools after the request's, and the response format (the request's, else a system message's)."""
    systems = [t for t in turns if t.role == "system"]
    if fmt.system_marker:
        systems = turns[:1] if turns and turns[0].role == "system" else []
    head = _Turn(role="system", text="\n\n".join(t.text for t in systems))
    head.tools = [*(tools or []), *(tool for t in systems for tool in (t.tools or []))] or None
    head.response_format = next((t.response_format for t in systems if t.response_format), None)
    if response_format is not None:
        head.response_format = _response_format(response_format, messages, fmt)
    return head


def _response_format(response_format: Mapping[str, Any], messages: Sequence[Mapping[str, Any]],
                     fmt: PromptFormat) -> Any:
    """What a request's `response_format` puts in the head: a json_schema's schema, json_object's fixed
    instruction (as OpenAI's, it needs the word "json" in the conversation), nothing for text."""
    kind = response_format.get("type")
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        return spec.get("schema") if isinstance(spec, Mapping) else None
    if kind == "json_object":
        if "json" not in json.dumps([m.get("content") for m in messages], ensure_ascii=False).lower():
            raise ValueError("the messages must contain the word 'json' in some form to use a response_format "
                             "of type 'json_object'")
        return {"type": "json_object"} if fmt.json_object_as_schema else _JSON_OBJECT
    return None


_JSON_OBJECT = object()  # json_object's instruction stands in the head in place of a schema


def _render_turn(turn: _Turn, with_reasoning: bool, fmt: PromptFormat) -> Pieces:
    if turn.role == "system":  # V4.1: a system message after the first, marked in place
        return [Special(SYSTEM), turn.text, *_instructions(turn, fmt)]
    if turn.role == "developer":
        return [Special(USER), turn.text, *_instructions(turn, fmt)]
    if turn.role == "user":
        out: Pieces = [Special(USER)]
        for k, part in enumerate(turn.parts):
            out += ["\n\n"] * (k > 0) + _render_part(part, fmt)
        return out
    if turn.role == "latest_reminder":
        return [Special(LATEST_REMINDER), turn.text]
    think = [Special(THINK_START), turn.reasoning or "", Special(THINK_END)] if with_reasoning \
        else [Special(THINK_END)]
    end = [] if turn.prefix else [Special(EOS)]
    return [Special(ASSISTANT), *think, turn.text, *_render_tool_calls(turn.tool_calls, fmt), *end]


def _instructions(turn: _Turn, fmt: PromptFormat) -> Pieces:
    out: Pieces = []
    if turn.tools:
        schemas = "\n".join(_to_json(_function_schema(t)) for t in turn.tools)
        out += ["\n\n", *_markup(fmt.tools_header()), schemas, _TOOLS_FOOTER]
    if turn.response_format is _JSON_OBJECT:
        out.append("\n\n" + _JSON_OBJECT_FORMAT)
    elif turn.response_format:
        out.append("\n\n" + _RESPONSE_FORMAT_HEADER + _to_json(turn.response_format))
    return out


def _render_part(part: tuple[str, str, str], fmt: PromptFormat) -> Pieces:
    kind, text, _ = part
    if kind == "image":
        return [fmt.image_text] if fmt.image_text is not None else [Special(IMAGE)]
    return [f"<tool_result>{text}</tool_result>" if kind == "tool_result" else text]


def _render_tool_calls(calls: Sequence[Mapping[str, Any]], fmt: PromptFormat) -> Pieces:
    if not calls:
        return []
    out = ["\n\n", *_markup(f"<{fmt.tag(fmt.block)}>\n")]
    for k, call in enumerate(calls):
        out += (["\n"] if k else []) + _render_invoke(call, fmt)
    return [*out, *_markup(f"\n</{fmt.tag(fmt.block)}>")]


def _render_invoke(call: Mapping[str, Any], fmt: PromptFormat) -> Pieces:
    function = call["function"]
    out = [*_markup(f"<{fmt.tag('invoke')}"), ' name="', function["name"], '">\n']
    arguments = _call_arguments(function)
    for key, value in arguments.items():
        out += [*_render_parameter(key, value, fmt), "\n"]
    if not arguments and fmt.blank_empty_invoke:
        out.append("\n")
    return [*out, *_markup(f"</{fmt.tag('invoke')}>")]


def _render_parameter(name: str, value: Any, fmt: PromptFormat) -> Pieces:
    is_str = isinstance(value, str)
    body = value if is_str else _to_json(value)
    flag = "true" if is_str else "false"
    return [*_markup(f"<{fmt.tag('parameter')}"), f' name="{name}" string="{flag}">', body,
            *_markup(f"</{fmt.tag('parameter')}>")]


def _call_arguments(function: Mapping[str, Any]) -> dict[str, Any]:
    raw = function.get("arguments")
    if isinstance(raw, Mapping):
        return dict(raw)
    if raw is None or raw == "":
        return {}
    try:
        parsed = json.loads(raw)
    except (TypeError, json.JSONDecodeError):
        parsed = None
    # Arguments that are not a JSON object are passed through as one string parameter, which is
    # what the reference encoder does with them.
    return parsed if isinstance(parsed, dict) else {"arguments": raw}


def _function_schema(tool: Any) -> Any:
    if isinstance(tool, Mapping) and "function" in tool:
        return tool["function"]
    return tool


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------
# Message validation and the reference's preprocessing (tool merging, reasoning dropping)
# ---------------------------------------------------------------------------------------------


def _parse_message(index: int, message: Mapping[str, Any]) -> _Turn:
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be an object")
    role = message.get("role")
    if role not in SUPPORTED_ROLES:
        raise ValueError(
            f"messages[{index}]: unsupported role {role!r}; expected one of {', '.join(SUPPORTED_ROLES)}"
        )
    text = _content_text(message.get("content"), f"messages[{index}].content")
    if role == "developer" and not text:
        raise ValueError(f"messages[{index}]: a developer message needs non-empty content")
    if role == "user" and isinstance(message.get("content"), list):  # a part each (an image may be a token)
        parts = [_user_part(c, f"messages[{index}].content[{k}]") for k, c in enumerate(message["content"])]
        return _Turn(role="user", parts=parts or [("text", "", "")])
    if role in ("user", "tool"):
        kind = "text" if role == "user" else "tool_result"
        call_id = str(message.get("tool_call_id") or "")
        return _Turn(role="user", parts=[(kind, text, call_id)])
    return _Turn(
        role=role,
        text=text,
        reasoning=_optional_str(message.get("reasoning_content"), f"messages[{index}].reasoning_content"),
        tool_calls=_validated_tool_calls(message.get("tool_calls"), index) if role == "assistant" else [],
        tools=list(message["tools"]) if role in ("system", "developer") and message.get("tools") else None,
        response_format=message.get("response_format") if role in ("system", "developer") else None,
        prefix=role == "assistant" and _prefix(message, index),
    )


def _prefix(message: Mapping[str, Any], index: int) -> bool:
    prefix = message.get("prefix", False)
    if not isinstance(prefix, bool):
        raise ValueError(f"messages[{index}].prefix must be a boolean")
    if prefix and message.get("tool_calls"):
        raise ValueError(f"messages[{index}]: an assistant prefix cannot carry tool calls")
    return prefix


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n\n".join(_text_part(part, f"{where}[{i}]") for i, part in enumerate(content))
    raise ValueError(f"{where} must be a string or a list of text parts")


def _text_part(part: Any, where: str) -> str:
    if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if isinstance(part, Mapping) and part.get("type") == "image_url":
        return UNSUPPORTED_IMAGE  # as DeepSeek's converter renders an image for V4
    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    raise ValueError(f"{where}: unsupported content part {repr(kind)[:64]}; text and image_url parts are supported")


def _user_part(part: Any, where: str) -> tuple[str, str, str]:
    if isinstance(part, Mapping) and part.get("type") == "image_url":
        return ("image", "", "")
    return ("text", _text_part(part, where), "")


def _optional_str(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{where} must be a string")


def _validated_tool_calls(calls: Any, index: int) -> list[Mapping[str, Any]]:
    if not calls:
        return []
    if not isinstance(calls, list):
        raise ValueError(f"messages[{index}].tool_calls must be a list")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"messages[{index}].tool_calls[{j}] needs function.name")
        if not isinstance(function.get("arguments"), (str, Mapping, type(None))):
            raise ValueError(f"messages[{index}].tool_calls[{j}].function.arguments must be a string")
    return list(calls)


def _merge_user_turns(turns: list[_Turn]) -> list[_Turn]:
    """Fold runs of user and tool messages into single user turns, tool results in call order."""
    merged: list[_Turn] = []
    for turn in turns:
        if turn.role == "user" and merged and merged[-1].role == "user":
            merged[-1].parts.extend(turn.parts)
        else:
            merged.append(turn)
    # Results answer the most recent assistant turn that made calls.
    call_order: dict[str, int] = {}
    for turn in merged:
        if turn.role == "assistant" and turn.tool_calls:
            call_order = {_call_id(c): k for k, c in enumerate(turn.tool_calls) if _call_id(c)}
        elif turn.role == "user":
            _sort_tool_results(turn, call_order)
    return merged


def _call_id(call: Mapping[str, Any]) -> str:
    return str(call.get("id") or call.get("function", {}).get("id") or "")


def _sort_tool_results(turn: _Turn, call_order: dict[str, int]) -> None:
    # Only tool results move; text parts keep their slots. Results with an unknown id sort as
    # the first call, and ties keep arrival order.
    results = [p for p in turn.parts if p[0] == "tool_result"]
    if len(results) < 2 or not call_order:
        return
    ordered = iter(sorted(results, key=lambda p: call_order.get(p[2], 0)))
    turn.parts = [next(ordered) if p[0] == "tool_result" else p for p in turn.parts]


def _drop_old_developers(body: list[_Turn]) -> list[_Turn]:
    """Thinking mode without tools: a developer message before the last user turn is dropped."""
    last_user = max((i for i, t in enumerate(body) if t.role in ("user", "developer")), default=-1)
    return [t for i, t in enumerate(body) if t.role != "developer" or i >= last_user]
