"""DeepSeek-V4 prompt encoding: OpenAI-style messages → the prompt string the model was trained on.

The format is DeepSeek's own V4 encoding (``encoding/encoding_dsv4.py`` and
``encoding/README.md`` in the DeepSeek-V4-Flash / DeepSeek-V4-Pro model repositories); there is
no Jinja chat template. A conversation renders as::

    BOS{system}<｜User｜>{user}<｜Assistant｜></think>{answer}EOS<｜User｜>{user}<｜Assistant｜></think>

and in thinking mode the turn being answered opens ``<think>`` instead, the model writes
``{reasoning}</think>{answer}EOS``. Points where the official format is more specific than
DESIGN.md's summary (the official one is followed):

- In thinking mode, earlier turns lose more than their reasoning: their header is rendered
  ``<｜Assistant｜></think>`` exactly as in chat mode; only turns after the last user message
  keep ``<think>`` and ``{reasoning}</think>``. A ``developer`` message before the last user
  message is dropped as well.
- When any message declares ``tools``, nothing is dropped: every turn keeps ``<think>`` and its
  reasoning, so thinking mode with tools is prefix-stable across turns like chat mode.
- The system prompt has no role marker (bare text after BOS). Tool schemas are appended to it
  after a blank line, as a fixed "## Tools" instruction block.
- There is no tool role in the rendered prompt: ``tool`` messages and the ``user`` messages
  around them merge into one user turn whose parts are joined by a blank line, each tool result
  wrapped in ``<tool_result>…</tool_result>`` and ordered like the calls that produced it.
  Assistant tool calls are written in DSML after a blank line, before EOS.
- ``developer`` renders like a user turn; ``latest_reminder`` is a role of its own.
- ``reasoning_effort="max"`` prepends a fixed instruction in thinking mode; other efforts add
  nothing.

v4serve's own choices where the reference has none: OpenAI content-part lists are accepted when
every part is text (joined by a blank line); request-level ``tools`` go on the first system
message, or on an empty one put first; ``add_generation_prompt=False`` leaves out the final
``<｜Assistant｜>`` header.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from v4serve.server.text.tokenizer import ASSISTANT, BOS, DSML, EOS, LATEST_REMINDER, THINK_END, THINK_START, USER

SUPPORTED_ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
_REASONING_EFFORTS = (None, "low", "medium", "high", "max")

# Fixed prompt text the model was trained with; it must match byte for byte.
_EFFORT_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)

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

_TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
_TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"


@dataclass
class _Turn:
    """One message after validation; user turns carry their merged parts."""

    role: str
    text: str = ""
    reasoning: str | None = None
    tool_calls: list[Mapping[str, Any]] = field(default_factory=list)
    tools: list[Any] | None = None
    response_format: Any = None
    # user turns: (kind, text, tool_call_id) with kind "text" or "tool_result"
    parts: list[tuple[str, str, str]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    thinking: bool = False,
    add_generation_prompt: bool = True,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_effort: str | None = None,
    drop_thinking: bool = True,
) -> str:
    """Render OpenAI-style ``messages`` as a DeepSeek-V4 prompt string (BOS included).

    Raises ``ValueError`` for anything the format cannot express (unknown roles, malformed tool
    calls, non-text content parts), so a server can answer 400.
    """
    if reasoning_effort not in _REASONING_EFFORTS:
        allowed = ", ".join(str(e) for e in _REASONING_EFFORTS[1:])
        raise ValueError(f"reasoning_effort must be one of {allowed}; got {repr(reasoning_effort)[:64]}")
    turns = _merge_user_turns([_parse_message(i, m) for i, m in enumerate(messages)])
    if not turns and not tools:
        raise ValueError("messages must not be empty")
    _attach_request_tools(turns, tools)
    has_tools = any(t.tools for t in turns)
    drop = thinking and drop_thinking and not has_tools
    if drop:
        turns = _drop_old_reasoning(turns)
    effort_prefix = _EFFORT_MAX_PREFIX if thinking and reasoning_effort == "max" else ""
    ctx = _RenderContext(turns, thinking, drop, add_generation_prompt)
    return BOS + effort_prefix + "".join(ctx.render(i) for i in range(len(turns)))


@dataclass
class _RenderContext:
    turns: list[_Turn]
    thinking: bool
    drop: bool
    add_generation_prompt: bool
    last_user: int = field(init=False)

    def __post_init__(self) -> None:
        self.last_user = _last_user_index(self.turns)

    def keeps_reasoning(self, index: int, *, header: bool) -> bool:
        # The header of the last user turn and the assistant turns after it always think;
        # earlier ones only when nothing is being dropped.
        if not self.thinking:
            return False
        after_last_user = index >= self.last_user if header else index > self.last_user
        return not self.drop or after_last_user

    def render(self, index: int) -> str:
        turn = self.turns[index]
        return _render_body(turn, self.keeps_reasoning(index, header=False)) + self.header_after(index)

    def header_after(self, index: int) -> str:
        """The ``<｜Assistant｜>`` header that follows a user turn whose answer comes next."""
        if self.turns[index].role not in ("user", "developer"):
            return ""
        is_last = index + 1 == len(self.turns)
        if is_last and not self.add_generation_prompt:
            return ""
        if not is_last and self.turns[index + 1].role not in ("assistant", "latest_reminder"):
            return ""
        think = THINK_START if self.keeps_reasoning(index, header=True) else THINK_END
        return ASSISTANT + think


def _render_body(turn: _Turn, with_reasoning: bool) -> str:
    if turn.role == "system":
        return turn.text + _instructions(turn)
    if turn.role == "developer":
        return USER + turn.text + _instructions(turn)
    if turn.role == "user":
        return USER + "\n\n".join(_render_part(p) for p in turn.parts)
    if turn.role == "latest_reminder":
        return LATEST_REMINDER + turn.text
    reasoning = (turn.reasoning or "") + THINK_END if with_reasoning else ""
    return reasoning + turn.text + _render_tool_calls(turn.tool_calls) + EOS


def _instructions(turn: _Turn) -> str:
    out = ""
    if turn.tools:
        schemas = "\n".join(_to_json(_function_schema(t)) for t in turn.tools)
        out += "\n\n" + _TOOLS_HEADER + schemas + _TOOLS_FOOTER
    if turn.response_format:
        out += "\n\n" + _RESPONSE_FORMAT_HEADER + _to_json(turn.response_format)
    return out


def _render_part(part: tuple[str, str, str]) -> str:
    kind, text, _ = part
    return f"<tool_result>{text}</tool_result>" if kind == "tool_result" else text


def _render_tool_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    if not calls:
        return ""
    invokes = "\n".join(_render_invoke(c) for c in calls)
    return f"\n\n{_TOOL_CALLS_OPEN}\n{invokes}\n{_TOOL_CALLS_CLOSE}"


def _render_invoke(call: Mapping[str, Any]) -> str:
    function = call["function"]
    params = "\n".join(_render_parameter(k, v) for k, v in _call_arguments(function).items())
    return f'<{DSML}invoke name="{function["name"]}">\n{params}\n</{DSML}invoke>'


def _render_parameter(name: str, value: Any) -> str:
    is_str = isinstance(value, str)
    body = value if is_str else _to_json(value)
    flag = "true" if is_str else "false"
    return f'<{DSML}parameter name="{name}" string="{flag}">{body}</{DSML}parameter>'


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
    )


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
    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    raise ValueError(f"{where}: unsupported content part {repr(kind)[:64]}; only text parts are supported")


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


def _attach_request_tools(turns: list[_Turn], tools: Sequence[Mapping[str, Any]] | None) -> None:
    if not tools:
        return
    if not turns or turns[0].role != "system":
        turns.insert(0, _Turn(role="system"))
    turns[0].tools = list(tools)


def _last_user_index(turns: Sequence[_Turn]) -> int:
    for i in range(len(turns) - 1, -1, -1):
        if turns[i].role in ("user", "developer"):
            return i
    return -1


def _drop_old_reasoning(turns: list[_Turn]) -> list[_Turn]:
    last_user = _last_user_index(turns)
    kept: list[_Turn] = []
    for i, turn in enumerate(turns):
        if i >= last_user or turn.role in ("system", "user", "latest_reminder"):
            kept.append(turn)
        elif turn.role == "assistant":
            kept.append(_Turn(role="assistant", text=turn.text, tool_calls=turn.tool_calls))
        # an earlier developer message is dropped altogether
    return kept
