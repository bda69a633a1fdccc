"""Tools, `tool_choice` and `response_format` on the request side: checked (a 400 naming the
parameter for anything malformed), then turned into what the engine enforces.

Forced tool calls (`required`, or a named function) become a Lark grammar for DeepSeek-V4's DSML
tool-call block, written from the same format `text.chat_encoding` renders calls in:

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="P" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="Q" string="false">{"json":"value"}</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

String-typed parameters are raw text (an enum becomes alternatives), the others a JSON sub-schema;
properties come in the schema's order, required ones always. `response_format` becomes a JSON
schema. Whitespace is compact in both, so a weak model cannot pad until max_tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema_rs

from v4serve.engine.request import GrammarSpec
from v4serve.server.errors import ApiError, echo
from v4serve.server.text.tokenizer import DSML

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_COMPACT = {"whitespace_flexible": False}
# Forced calls in one reply, at most: a weak model must not repeat calls until max_tokens.
MAX_PARALLEL_CALLS = 8
# Levels of objects and arrays a tool's or response format's schema may nest: deeper ones are refused
# before the checker walks them (a native checker recursing 20,000 levels down crashes its process; the
# pure-Python one it replaced stopped at about 80 `anyOf` levels).
MAX_SCHEMA_DEPTH = 256
# The meta-schemas the checker has built in. Any other `$schema` it would fetch over the network, which a
# request must never make the server do: such a schema is checked against the default draft (2020-12).
_BUILT_IN_DRAFTS = frozenset({
    "http://json-schema.org/draft-04/schema#", "http://json-schema.org/draft-04/schema",
    "http://json-schema.org/draft-06/schema#", "http://json-schema.org/draft-06/schema",
    "http://json-schema.org/draft-07/schema#", "http://json-schema.org/draft-07/schema",
    "https://json-schema.org/draft/2019-09/schema", "https://json-schema.org/draft/2019-09/schema#",
    "https://json-schema.org/draft/2020-12/schema", "https://json-schema.org/draft/2020-12/schema#",
})
NL = "\n"


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # a JSON schema for an object


@dataclass(frozen=True)
class ToolPlan:
    """What the request's tools mean for this generation."""

    offered: list[dict[str, Any]] | None  # tools written into the prompt (None: none offered)
    parse_calls: bool  # look for DSML calls in the output
    forced: list[Tool] | None  # calls must be to one of these (required / named), enforced by grammar
    parallel: bool = True
    tools: tuple[Tool, ...] = ()  # every tool, checked


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan:
    checked = [_check_tool(i, t) for i, t in enumerate(tools or [])]
    if len({t.name for t in checked}) != len(checked):
        raise ApiError(400, "tool names must be unique", param="tools")
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if checked else "none"
    if not checked:
        if tool_choice != "none":
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan(offered=None, parse_calls=False, forced=None)
    if tool_choice == "none":
        return ToolPlan(offered=None, parse_calls=False, forced=None)
    offered = [t if isinstance(t, dict) else dict(t) for t in tools or []]
    if tool_choice == "auto":
        return ToolPlan(offered, parse_calls=True, forced=None, parallel=parallel, tools=tuple(checked))
    if tool_choice == "required":
        return ToolPlan(offered, parse_calls=True, forced=checked, parallel=parallel, tools=tuple(checked))
    name = _named_choice(tool_choice)
    chosen = [t for t in checked if t.name == name]
    if not chosen:
        raise ApiError(400, f"tool_choice names {echo(name)}, which is not among the tools", param="tool_choice")
    offered = [t for t, c in zip(offered, checked, strict=True) if c.name == name]  # as DeepSeek's converter offers it
    return ToolPlan(offered, parse_calls=True, forced=chosen, parallel=False, tools=tuple(checked))


def _named_choice(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, 'tool_choice must be "none", "auto", "required" or '
                            '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    return name


def _check_tool(i: int, tool: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ApiError(400, f'{where} must be {{"type": "function", "function": {{...}}}}', param=where)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(400, f"{where}.function.name must be 1-64 letters, digits, _ or -",
                       param=f"{where}.function.name")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    param = f"{where}.function.parameters"
    _check_schema(parameters, param)
    if parameters.get("type", "object") != "object":
        raise ApiError(400, f"{param} must describe an object", param=param)
    return Tool(name, parameters)


def _check_schema(schema: Any, param: str) -> None:
    """A schema valid against its draft's meta-schema, checked by `jsonschema_rs` (a 10,000-property tool
    takes it ~10 ms; `jsonschema` took 5 s of a preprocessing worker against draft 2020-12)."""
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} must be a JSON schema object", param=param)
    if _deeper_than(schema, MAX_SCHEMA_DEPTH):
        raise ApiError(400, f"{param} nests too deeply to check (more than {MAX_SCHEMA_DEPTH} levels of objects and "
                            "arrays)", param=param)
    draft = schema.get("$schema")
    if draft is not None and not (isinstance(draft, str) and draft in _BUILT_IN_DRAFTS):
        schema = {k: v for k, v in schema.items() if k != "$schema"}
    try:
        jsonschema_rs.meta.validate(schema)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError) as exc:
        message = exc.message if isinstance(exc, jsonschema_rs.ValidationError) else str(exc)
        raise ApiError(400, f"{param} is not a valid JSON schema: {message}", param=param) from None
    bad = _bad_regex(schema)
    if bad is not None:
        raise ApiError(400, f"{param} is not a valid JSON schema: {echo(bad)} is not a 'regex'", param=param)


# Keywords whose values are data, not schemas: a "pattern" key in them is not a regex.
_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})


def _bad_regex(schema: dict[str, Any]) -> str | None:
    """The first `pattern` or `patternProperties` key that is not a regex (the meta-schemas' `format: regex`,
    which `jsonschema_rs.meta` does not check)."""
    stack: list[Any] = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        regexes = [item["pattern"]] if isinstance(item.get("pattern"), str) else []
        if isinstance(item.get("patternProperties"), dict):
            regexes += list(item["patternProperties"])
        for regex in regexes:
            try:
                re.compile(regex)
            except re.error:
                return regex
        stack.extend(v for k, v in item.items() if k not in _DATA_KEYWORDS and isinstance(v, (dict, list)))
    return None


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether objects and arrays nest in `value` more than `limit` levels (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


# ---- grammars ------------------------------------------------------------------------------------------
def tool_call_grammar(forced: list[Tool], parallel: bool, after_token: int | None,
                      prefilled: bool = False) -> GrammarSpec:
    """A forced call; `prefilled`: the prompt opened the block (chat mode), the reply starts inside it."""
    rules = ["start: inside" if prefilled else "start: calls", *_call_rules(forced, parallel)]
    return GrammarSpec("lark", "\n".join(rules), param="tool_choice", after_token=after_token)


def answer_grammar(tools: ToolPlan, response_format: Any, think_end: int | None,
                   prefilled: bool = False) -> GrammarSpec | None:
    """What a reply must be: under a required or named tool choice a call (a `response_format` is for the
    final answer, a later turn; `prefilled`: the prompt opened its block); under auto with a
    `response_format` a call or that answer; without tools the answer."""
    if tools.forced is not None:
        response_format_schema(response_format)  # checked all the same
        return tool_call_grammar(tools.forced, tools.parallel, think_end, prefilled)
    if tools.parse_calls:
        return call_or_answer_grammar(tools.tools, tools.parallel, response_format, think_end)
    return response_format_grammar(response_format, think_end)


def call_or_answer_grammar(tools: tuple[Tool, ...], parallel: bool, response_format: Any,
                           after_token: int | None) -> GrammarSpec | None:
    """`tool_choice` auto with a `response_format`: a call to one of the tools, or the formatted answer
    (None when the format is plain text: calls are then parsed, not enforced)."""
    schema = response_format_schema(response_format)
    if schema is None:
        return None
    answer = f"answer: %json {json.dumps({**schema, 'x-guidance': _COMPACT})}"
    rules = ["start: calls | answer", answer, *_call_rules(list(tools), parallel)]
    return GrammarSpec("lark", "\n".join(rules), param="response_format", after_token=after_token)


def _call_rules(tools: list[Tool], parallel: bool) -> list[str]:
    """Rules whose `calls` is DeepSeek-V4's tool-call block with calls to `tools`."""
    invokes = [_invoke_rules(i, tool) for i, tool in enumerate(tools)]
    rules = [rule for _, body in invokes for rule in body]
    any_invoke = " | ".join(name for name, _ in invokes)
    repeat = f"{{1,{MAX_PARALLEL_CALLS}}}" if parallel else ""
    block = f'calls: {_lit(NL * 2 + f"<{DSML}tool_calls>" + NL)} inside'
    inside = f'inside: call{repeat} {_lit(f"</{DSML}tool_calls>")}'
    return [block, inside, f"call: {any_invoke}", *rules]


def _invoke_rules(i: int, tool: Tool) -> tuple[str, list[str]]:
    properties = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or [])
    unknown = required - set(properties)
    if unknown:
        raise ApiError(400, f"tools[{i}].function.parameters requires {sorted(unknown)} without properties for them",
                       param=f"tools[{i}].function.parameters")
    # Sub-schemas keep the definitions their $refs point at.
    defs = {k: tool.parameters[k] for k in ("$defs", "definitions") if k in tool.parameters}
    rules, parts = [], []
    for j, (prop, schema) in enumerate(properties.items()):
        rule = f"p{i}_{j}"
        rules += _parameter_rules(rule, prop, schema if isinstance(schema, dict) else {}, defs,
                                  f"tools[{i}].function.parameters.properties.{prop}")
        parts.append(rule if prop in required else f"{rule}?")
    head = _lit(f'<{DSML}invoke name="{tool.name}">\n')
    body = " ".join(parts) if parts else _lit("\n")
    rules.insert(0, f"invoke{i}: {head} {body} {_lit(f'</{DSML}invoke>' + NL)}")
    return f"invoke{i}", rules


def _parameter_rules(rule: str, prop: str, schema: dict[str, Any], defs: dict[str, Any], where: str) -> list[str]:
    """`rule`: one parameter, its tags included and a newline after; `rule_v`: its value."""
    is_text = schema.get("type") == "string"
    head = _lit(f'<{DSML}parameter name="{prop}" string="{"true" if is_text else "false"}">')
    close = _lit(f"</{DSML}parameter>")
    tagged = f"{rule}: {head} {rule}_v {close} {_lit(NL)}"
    if not is_text:
        return [tagged, f"{rule}_v: %json {json.dumps({**schema, **defs, 'x-guidance': _COMPACT})}"]
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        return [tagged, f"{rule}_v: {' | '.join(_lit(str(v)) for v in values)}"]
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    if "pattern" in schema or high is not None or low:
        pattern = _checked_pattern(schema.get("pattern", ""), f"{where}.pattern")
        pattern = pattern.removeprefix("^").removesuffix("$") or f"(?s:.{{{low},{high or ''}}})"
        return [tagged, f"{rule}_v: /{_regex_body(pattern)}/"]
    # Any text: lazy, so the first closing tag ends it (the tag is part of the value's regex).
    any_text = f"(?s:.*){_regex_body(re.escape(f'</{DSML}parameter>'))}"
    return [f"{rule}: {head} {rule}_v {_lit(NL)}", f"{rule}_v[lazy]: /{any_text}/"]


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _checked_pattern(pattern: Any, param: str) -> str:
    if not isinstance(pattern, str):
        raise ApiError(400, f"{param} must be a string", param=param)
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ApiError(400, f"{param} is not a valid regular expression: {exc}", param=param) from None
    return pattern


_LITERAL_ESCAPES = {"/": "\\/", "\n": "\\n", "\r": "\\r"}


def _regex_body(pattern: str) -> str:
    """A valid regex as the body of a Lark `/regex/` literal: a `/` gets a backslash unless it has one,
    and line breaks are written as escapes, so nothing in the pattern can end the literal or the rule.
    Escapes are read in pairs: in `a\\\\/b` the `\\\\` is one escaped backslash, and the `/` still
    needs its own."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\" and i + 1 < len(pattern):
            escaped = pattern[i + 1]
            out.append("\\" + {"\n": "n", "\r": "r"}.get(escaped, escaped))
            i += 2
            continue
        out.append(_LITERAL_ESCAPES.get(pattern[i], pattern[i]))
        i += 1
    return "".join(out)


def response_format_grammar(response_format: Any, after_token: int | None) -> GrammarSpec | None:
    """None for plain text; a JSON-schema grammar for json_object and json_schema."""
    schema = response_format_schema(response_format)
    if schema is None:
        return None
    return GrammarSpec("json_schema", json.dumps(schema), param="response_format", after_token=after_token)


def response_format_schema(response_format: Any) -> dict[str, Any] | None:
    """The JSON schema a `response_format` asks for; None for plain text."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ApiError(400, 'response_format.json_schema needs a "name" and a "schema"',
                           param="response_format.json_schema")
        schema = spec.get("schema", {})
        _check_schema(schema, "response_format.json_schema.schema")
        return schema
    raise ApiError(400, f'response_format.type must be "text", "json_object" or "json_schema", got {echo(kind)}',
                   param="response_format.type")
