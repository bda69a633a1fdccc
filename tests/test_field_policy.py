"""The field policy, on the models and the Messages conversation (no daemon): unknown fields dropped and
named (`--unknown-fields accept`, the default) or refused naming them; system turns inside Messages'
`messages`, `context_management`'s clear_thinking, per-turn effort, tools the model cannot call left out;
and no DSML markup in text, on either tokenizer."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from v4serve.engine.process.client import TokenOutput
from v4serve.engine.request import Sample
from v4serve.server.body import header_value
from v4serve.server.errors import validation_message
from v4serve.server.messages import CountTokensRequest, MessagesRequest, conversation, effort, tool_plan
from v4serve.server.protocol import ChatCompletionRequest, validation_context
from v4serve.server.responses import FunctionTool, HostedTool, ResponsesRequest
from v4serve.server.text.chat_encoding import encode_messages
from v4serve.server.text.output import ChoiceText, OutputOptions
from v4serve.server.text.tokenizer import DSML, ByteTokenizer

CHAT = {"messages": [{"role": "user", "content": "hi", "bogus": 1}], "frobnicate": True}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def parse(model: type, body: dict, policy: str | None) -> tuple[object, dict]:
    context = validation_context(policy) if policy else None
    return model.model_validate_json(json.dumps(body), strict=True, context=context), context or {}


def test_unknown_fields_are_dropped_and_named_under_accept() -> None:
    body, context = parse(ChatCompletionRequest, CHAT, "accept")
    assert context["ignored"] == ["messages[].bogus", "frobnicate"]
    assert body.model_extra == {} and body.messages[0].model_extra == {}
    assert "frobnicate" not in body.model_dump() and body.messages[0].content == "hi"


@pytest.mark.parametrize("policy", ["refuse", None])  # None: validated internally, with no context
def test_unknown_fields_are_refused_naming_them(policy: str | None) -> None:
    with pytest.raises(ValidationError) as caught:
        parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, policy)
    assert validation_message(caught.value) == ("frobnicate: Extra inputs are not permitted (unknown field)",
                                                "frobnicate")
    with pytest.raises(ValidationError) as nested:
        parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi", "bogus": 1}]}, policy)
    assert validation_message(nested.value)[1] == "messages.0.bogus"


def test_a_known_field_with_a_wrong_value_is_refused_under_accept_too() -> None:
    with pytest.raises(ValidationError):
        parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, "accept")
    with pytest.raises(ValidationError):  # an edit v4serve cannot honour changes what the model sees
        parse(MessagesRequest, {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                                "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "accept")


def messages_request(messages: list[dict], **fields: object) -> MessagesRequest:
    body, _ = parse(MessagesRequest, {"model": "m", "max_tokens": 4, "messages": messages, **fields}, "refuse")
    return body


def test_a_system_turn_inside_messages_joins_the_system_prompt() -> None:
    """DeepSeek-V4 has no system marker: as DeepSeek's converter renders it, every system turn's text goes
    to the head, in order, wherever it stands among the messages."""
    body = messages_request([{"role": "user", "content": "first"},
                             {"role": "system", "content": [{"type": "text", "text": "ENVIRONMENT"}],
                              "output_config": {"effort": "medium"}},
                             {"role": "system", "content": []},  # Claude Code --bare sends this
                             {"role": "assistant", "content": "ok"},
                             {"role": "user", "content": "second"}], system="SYSTEM")
    turns = conversation(body.system, body.messages)
    assert [t["role"] for t in turns] == ["system", "user", "system", "assistant", "user"]
    prompt = encode_messages(turns)
    assert prompt.index("SYSTEM") < prompt.index("ENVIRONMENT") < prompt.index("first") < prompt.index("ok")
    assert prompt.index("ok") < prompt.index("second")


def test_clear_thinking_keeps_the_last_turns_thinking() -> None:
    def assistant(i: int) -> dict:
        return {"role": "assistant", "content": [{"type": "thinking", "thinking": f"T{i}"}, {"type": "text",
                                                                                            "text": f"A{i}"}]}

    history = [m for i in range(3) for m in ({"role": "user", "content": f"U{i}"}, assistant(i))]
    history.append({"role": "user", "content": "now"})

    def thinking(edit: dict | None) -> list[str]:
        fields = {"context_management": {"edits": [edit]}} if edit else {}
        body = messages_request(history, **fields)
        return [t.get("reasoning_content", "") for t in conversation(body.system, body.messages,
                                                                       body.context_management)
                if t["role"] == "assistant"]

    assert thinking(None) == ["T0", "T1", "T2"]
    assert thinking({"type": "clear_thinking_20251015", "keep": "all"}) == ["T0", "T1", "T2"]
    assert thinking({"type": "clear_thinking_20251015"}) == ["", "", "T2"]  # Anthropic's default: the last one
    assert thinking({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}) == \
        ["", "T1", "T2"]
    assert thinking({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 5}}) == \
        ["T0", "T1", "T2"]  # more than there are: all kept
    with pytest.raises(ValidationError):
        messages_request(history, context_management={"edits": [{"type": "clear_thinking_20251015",
                                                                  "keep": {"type": "thinking_turns", "value": 0}}]})


def test_the_latest_turn_that_sets_an_effort_wins() -> None:
    user = {"role": "user", "content": "hi"}
    assert effort(messages_request([user], output_config={"effort": "max"})) == "max"
    turn_max = {"role": "system", "content": "x", "output_config": {"effort": "max"}}
    turn_low = {"role": "system", "content": "y", "output_config": {"effort": "low"}}
    assert effort(messages_request([user, turn_max, user])) == "max"
    assert effort(messages_request([user, turn_max, turn_low, user], output_config={"effort": "max"})) == "low"
    assert effort(messages_request([user])) == "high"  # none set: the converter's default
    counted, _ = parse(CountTokensRequest, {"model": "m", "messages": [user], "output_config": {"effort": "max"}},
                       "refuse")
    assert effort(counted) == "max"  # the instruction is part of the prompt it counts


def test_tools_the_model_cannot_call_are_left_out_of_the_prompt() -> None:
    tools = [{"name": "Read", "input_schema": WEATHER},
             {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
             {"type": "bash_20250124", "name": "bash"}]
    body = messages_request([{"role": "user", "content": "hi"}], tools=tools)
    plan = tool_plan(body.tools, body.tool_choice)
    assert [t["function"]["name"] for t in plan.offered] == ["Read"]
    codex, _ = parse(ResponsesRequest, {"input": "hi", "tools": [
        {"type": "function", "name": "exec_command", "parameters": WEATHER},
        {"type": "namespace", "name": "multi_agent_v1", "tools": [{"type": "function", "name": "spawn_agent"}]},
        {"type": "web_search", "external_web_access": False}]}, "refuse")
    assert [type(t) for t in codex.tools] == [FunctionTool, HostedTool, HostedTool]
    assert codex.tools[1].model_dump()["tools"] == [{"type": "function", "name": "spawn_agent"}]  # returned as sent


@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("thinking", [False, True])
def test_a_lone_dsml_token_is_text_as_deepseeks_parser_reads_it(tools: bool, thinking: bool) -> None:
    """What the tiny model did in both CLIs: the `｜DSML｜` token alone, in the answer and the thinking. It opens
    no tag, so DeepSeek's parser (tests/test_parsing_oracle.py) keeps it as text, and so does v4serve."""
    tok = ByteTokenizer()
    dsml, think_end = tok.token_to_id(DSML), tok.token_to_id("</think>")
    ids = [*tok.encode("think"), dsml, *([think_end] if thinking else []), *tok.encode("Hi"), dsml, *tok.encode("!")]
    text = ChoiceText(tok, OutputOptions(tool_calls=tools, reasoning_end_token=think_end if thinking else None))
    deltas = [text.push(TokenOutput(0, (t,), (Sample(t, 0.0, []),))) for t in ids]
    deltas.append(text.push(TokenOutput(0, finished=True, finish_reason="stop")))
    content, reasoning = "".join(d.text for d in deltas), "".join(d.reasoning for d in deltas)
    think, hi = f"think{DSML}", f"Hi{DSML}!"
    assert (reasoning, content) == ((think, hi) if thinking else ("", think + hi))


def test_the_header_names_any_field_a_client_sends_as_a_legal_header_value() -> None:
    """A name is anything a client sent: empty, spaces, CR/LF or non-ASCII would make an illegal header (the
    reply was dropped with the connection); such names come as ASCII JSON strings, cut at 1 KiB."""
    value = header_value(["", "messages[].", " a ", "x\r\n", "ok_name", "tools[].café"])
    assert value == b'"", messages[]., " a ", "x\\r\\n", ok_name, "tools[].caf\\u00e9"'
    long = header_value(["f" * 600, "g" * 600])
    assert len(long) <= 1024 and long == (b"f" * 600 + b", " + b"g" * 422)
    assert not header_value(["a" * 1022, "b"]).endswith(b" ")
