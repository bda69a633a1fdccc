"""Anthropic's Messages API (`/v1/messages`) through Anthropic's own SDK against a real daemon (the
tiny model, an API key the SDK sends as `x-api-key`): replies, streams, tools and their results,
thinking with its budget, stop sequences, token counting and errors in Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.daemon import PATIENCE, daemon

MODEL = "v4serve-tiny"
KEY = "sk-messages"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Zürich"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "the weather", "input_schema": WEATHER}]
# This SDK no longer has a temperature argument; the API (and v4serve) still take one.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with daemon("--api-key", KEY) as served:
        yield served


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=PATIENCE) as c:
        yield c


def ask(client: anthropic.Anthropic, text: str = "Hello there", **kwargs: Any) -> Any:
    return client.messages.create(**{"model": MODEL, "max_tokens": 12, "extra_body": GREEDY,
                                     "messages": [{"role": "user", "content": text}], **kwargs})


def test_a_reply_and_its_stream_are_the_same_message(client: anthropic.Anthropic) -> None:
    reply = ask(client, system="Be brief.")
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert reply.id.startswith("msg_") and [b.type for b in reply.content] == ["text"]
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    assert reply.usage.output_tokens <= 12 and reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 0
    with client.messages.stream(model=MODEL, max_tokens=12, extra_body=GREEDY, system="Be brief.",
                                messages=[{"role": "user", "content": "Hello there"}]) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text == reply.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (reply.stop_reason, reply.usage.output_tokens)


def test_a_forced_tool_its_result_and_the_cached_prefix(client: anthropic.Anthropic) -> None:
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    reply = ask(client, "Weather in Paris?", max_tokens=300, tools=TOOLS, tool_choice=choice)
    assert reply.stop_reason == "tool_use"
    (call,) = [b for b in reply.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    with client.messages.stream(model=MODEL, max_tokens=300, extra_body=GREEDY, tools=TOOLS, tool_choice=choice,
                                messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(call.name, call.input)]
    follow_up = [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
    second = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, tools=TOOLS, messages=follow_up)
    assert second.usage.cache_read_input_tokens > 0  # the first turn's prompt, from the prefix cache
    counted = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=follow_up)
    assert counted.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens


def test_a_call_cut_off_by_max_tokens_is_a_tool_use_block(client: anthropic.Anthropic) -> None:
    choice = {"type": "any", "disable_parallel_tool_use": True}
    whole = ask(client, "Weather?", max_tokens=300, tools=TOOLS, tool_choice=choice)
    n = whole.usage.output_tokens
    cut = ask(client, "Weather?", max_tokens=n - 8, tools=TOOLS, tool_choice=choice)
    assert cut.stop_reason == "max_tokens" and [b.type for b in cut.content] == ["tool_use"]
    full = next(b for b in whole.content if b.type == "tool_use").input
    assert cut.content[0].name == "get_weather" and cut.content[0].input.items() <= full.items()


def test_thinking_stops_at_its_budget(client: anthropic.Anthropic, url: str) -> None:
    """With a budget of 6 the thinking is the first 6 tokens the model thinks (what chat completions
    gives at max_tokens 6 in thinking mode), then `</think>` is forced and the answer follows."""
    reply = ask(client, "Think, then answer.", max_tokens=14, thinking={"type": "enabled", "budget_tokens": 6})
    assert [b.type for b in reply.content][:1] == ["thinking"]
    chat = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=PATIENCE,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Think, then answer."}],
                            "max_tokens": 6, "temperature": 0, "thinking": True}).json()
    assert chat["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6  # no </think> of its own
    assert reply.content[0].thinking == chat["choices"][0]["message"]["reasoning_content"]
    assert reply.usage.output_tokens == 14 or reply.stop_reason == "end_turn"
    with client.messages.stream(model=MODEL, max_tokens=14, extra_body=GREEDY, thinking={"type": "enabled",
                                "budget_tokens": 6}, messages=[{"role": "user", "content": "Think, then answer."}]
                                ) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in reply.content]
    assert kinds[0] == "thinking_delta"


def test_a_stop_sequence_is_named(client: anthropic.Anthropic) -> None:
    text = ask(client, max_tokens=16).content[0].text
    stop = text[4:6]
    reply = ask(client, max_tokens=16, stop_sequences=[stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == text[:text.index(stop)]


@pytest.mark.parametrize("fields, says", [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}]},
     "messages.0.content"),
    ({"thinking": {"type": "enabled", "budget_tokens": 50}}, "less than max_tokens"),
    ({"tool_choice": {"type": "tool"}, "tools": TOOLS}, '"tool" needs a "name"'),
    ({"extra_body": {"top_k": -1}}, "top_k"),
    ({"thinking": {"type": "between_tools"}}, "thinking"),
])
def test_bad_requests_get_anthropics_error_shape(client: anthropic.Anthropic, fields: dict, says: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        ask(client, **fields)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    assert says in caught.value.body["error"]["message"]


def test_unknown_model_and_wrong_key(client: anthropic.Anthropic, url: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        ask(client, model="claude-nonexistent")
    assert caught.value.body["error"]["type"] == "not_found_error"
    with anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0) as other:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            ask(other)
    assert refused.value.body["error"]["type"] == "authentication_error"
    raw = httpx.post(url + "/messages", headers={"x-api-key": KEY}, timeout=PATIENCE,  # DeepSeek's base URL
                     json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert raw.status_code == 200 and json.loads(raw.text)["type"] == "message"


def test_output_format_effort_and_hidden_thinking(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    formatted = ask(client, max_tokens=40, output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(formatted.content[0].text), schema)
    adaptive = ask(client, thinking={"type": "adaptive"})
    most = ask(client, thinking={"type": "adaptive"}, output_config={"effort": "max"})
    assert most.usage.input_tokens > adaptive.usage.input_tokens  # V4's maximum-effort instruction
    assert adaptive.content[0].type == "thinking" and adaptive.content[0].thinking
    hidden = ask(client, thinking={"type": "adaptive", "display": "omitted"})
    assert hidden.content[0].type == "thinking" and hidden.content[0].thinking == ""
    assert [b.model_dump() for b in hidden.content[1:]] == [b.model_dump() for b in adaptive.content[1:]]
