"""Tool calls and structured outputs through the real daemon with the `openai` SDK. The tiny model
has random weights, so what it writes is noise: forced calls and response formats must still be
valid (the grammar makes them so) and the streamed form must equal the non-streamed one."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.daemon import PATIENCE

MODEL = "v4serve-tiny"
ASK = [{"role": "user", "content": "What should I do today?"}]


def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": parameters}}


# Schemas a random model can finish: bounded strings, enums, numbers and booleans end quickly.
SCHEMAS = {
    "enums and bounded integers": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Zürich", "北京"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "hourly": {"type": "boolean"}},
        "required": ["city", "days"], "additionalProperties": False},
    "nested object": {
        "type": "object", "properties": {"where": {"type": "object", "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["lat", "unit"],
            "additionalProperties": False}}, "required": ["where"], "additionalProperties": False},
    "array of objects": {
        "type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["id"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    "bounded free text, optional fields": {
        "type": "object", "properties": {"note": {"type": "string", "maxLength": 12},
                                         "tag": {"type": "string", "enum": ["a", "b"]},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 3}},
        "required": ["note"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=PATIENCE) as c:
        yield c


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(**{"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 400,
                                             **kwargs})


def streamed_calls(client: openai.OpenAI, **kwargs: Any) -> tuple[list[dict[str, str]], str | None, str]:
    """(calls as {name, arguments} reassembled from the deltas, finish reason, content) of a stream."""
    return streamed_calls_of(lambda **kw: chat(client, **kw), **kwargs)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_named_tool_choice_gives_a_valid_call_streamed_alike(client: openai.OpenAI, name: str) -> None:
    tools = [tool("first", SCHEMAS[name]), tool("other", {"type": "object", "properties": {}})]
    choice = {"type": "function", "function": {"name": "first"}}
    reply = chat(client, tools=tools, tool_choice=choice)
    c = reply.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "first" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])
    calls, finish, content = streamed_calls(client, tools=tools, tool_choice=choice)
    assert finish == "tool_calls" and content == ""
    assert calls == [{"name": "first", "arguments": call.function.arguments}]


def test_required_tool_choice_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    tools = [tool(f"t{i}", schema) for i, schema in enumerate(SCHEMAS.values())]
    reply = chat(client, tools=tools, tool_choice="required", parallel_tool_calls=False)
    (call,) = reply.choices[0].message.tool_calls
    index = int(call.function.name[1:])
    jsonschema.validate(json.loads(call.function.arguments), list(SCHEMAS.values())[index])
    assert reply.choices[0].finish_reason == "tool_calls"


def test_required_with_parallel_calls(client: openai.OpenAI) -> None:
    tools = [tool("ping", {"type": "object", "properties": {}}), tool("pong", {"type": "object", "properties": {}})]
    reply = chat(client, tools=tools, tool_choice="required")
    calls = reply.choices[0].message.tool_calls
    assert 1 <= len(calls) <= 8 and all(c.function.name in ("ping", "pong") for c in calls)
    assert all(json.loads(c.function.arguments) == {} for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    streamed, finish, _ = streamed_calls(client, tools=tools, tool_choice="required")
    assert streamed == [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]


def test_tool_choice_none_and_auto(client: openai.OpenAI, base_url: str) -> None:
    tools = [tool("first", SCHEMAS["enums and bounded integers"])]
    prompt_none = httpx.post(base_url + "/tokenize", json={"messages": ASK}, timeout=PATIENCE).json()["count"]
    none = chat(client, tools=tools, tool_choice="none", max_tokens=4)
    assert none.usage.prompt_tokens == prompt_none  # no tools offered in the prompt
    auto = chat(client, tools=tools, max_tokens=4)
    assert auto.usage.prompt_tokens > prompt_none  # offered (auto is the default with tools)
    assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_thinking_keeps_reasoning_apart_and_the_call_comes_after(client: openai.OpenAI, base_url: str) -> None:
    think_end = httpx.post(base_url + "/tokenize", json={"prompt": "</think>", "add_special_tokens": False},
                           timeout=PATIENCE).json()
    tools = [tool("first", SCHEMAS["enums and bounded integers"])]
    reply = chat(client, tools=tools, tool_choice={"type": "function", "function": {"name": "first"}},
                 extra_body={"thinking": True, "logit_bias": {str(think_end["tokens"][0]): 50}})
    c = reply.choices[0]
    assert c.message.model_extra["reasoning_content"] == ""  # the bias closed the thinking at once
    jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), SCHEMAS["enums and bounded integers"])


def test_response_format_json_schema_and_json_object(client: openai.OpenAI) -> None:
    for schema in SCHEMAS.values():
        fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
        text = chat(client, response_format=fmt).choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), text  # compact: no free whitespace
    # As OpenAI's (and DeepSeek's converter), json_object needs the word "json" in the conversation.
    json_ask = [{"role": "user", "content": "What should I do today? Answer in JSON."}]
    obj = chat(client, messages=json_ask, response_format={"type": "json_object"}, max_tokens=800).choices[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content), dict)
    with pytest.raises(openai.BadRequestError, match="the word 'json'"):
        chat(client, response_format={"type": "json_object"})


class Forecast(BaseModel):
    city: Literal["Paris", "Lima"]
    days: int = Field(ge=1, le=5)
    sunny: bool


def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    parsed = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Forecast, temperature=0,
                                           max_tokens=200)
    forecast = parsed.choices[0].message.parsed
    assert isinstance(forecast, Forecast) and parsed.choices[0].finish_reason == "stop"


def test_constrained_requests_do_not_change_free_ones(base_url: str, client: openai.OpenAI) -> None:
    free = {"model": MODEL, "messages": [{"role": "user", "content": "free text please"}], "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}
    solo = httpx.post(base_url + "/v1/chat/completions", json=free, timeout=PATIENCE).json()["choices"][0]["message"]
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMAS["nested object"]}}
    with httpx.Client(base_url=base_url, timeout=PATIENCE) as http:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(6) as pool:
            constrained = [pool.submit(http.post, "/v1/chat/completions",
                                       json={**free, "ignore_eos": False, "response_format": fmt, "max_tokens": 200})
                           for _ in range(3)]
            frees = [pool.submit(http.post, "/v1/chat/completions", json=free) for _ in range(3)]
            assert all(f.result().json()["choices"][0]["message"] == solo for f in frees)
            assert all(jsonschema.validate(json.loads(f.result().json()["choices"][0]["message"]["content"]),
                                           SCHEMAS["nested object"]) is None for f in constrained)


# ---- bad requests ---------------------------------------------------------------------------------------------
GOOD = tool("f", {"type": "object", "properties": {"x": {"type": "integer"}}})
BAD = {
    "unknown function in tool_choice": (
        {"tools": [GOOD], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    "tool_choice without tools": ({"tool_choice": "required"}, "tool_choice"),
    "tool_choice nonsense": ({"tools": [GOOD], "tool_choice": "sometimes"}, "tool_choice"),
    "tool without function": ({"tools": [{"type": "function"}]}, "tools[0]"),
    "tool of another type": ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0]"),
    "tool name with spaces": ({"tools": [tool("get weather", {"type": "object"})]}, "tools[0].function.name"),
    "invalid parameters schema": ({"tools": [tool("f", {"type": "object", "properties": {"x": {"type": 5}}})]},
                                  "tools[0].function.parameters"),
    "parameters not an object": ({"tools": [tool("f", {"type": "array"})]}, "tools[0].function.parameters"),
    "duplicate tool names": ({"tools": [GOOD, GOOD]}, "tools"),
    "response_format nonsense": ({"response_format": {"type": "nonsense"}}, "response_format.type"),
    "json_schema without name": ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
                                 "response_format.json_schema"),
    "invalid json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "o", "schema": {"type": "strin"}}}}, "response_format.json_schema.schema"),
    "schema the grammar engine cannot enforce": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "o", "schema": {"type": "object", "not": {"required": ["a"]}}}}}, "response_format"),
    "a bad response_format beside a forced call": ({"tools": [GOOD], "tool_choice": "required",
                                                    "response_format": {"type": "yaml"}}, "response_format.type"),
    "an unknown chat_template_kwargs key": ({"chat_template_kwargs": {"add_generation_prompt": False}},
                                            "chat_template_kwargs"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tool_and_format_requests(base_url: str, case: str) -> None:
    fields, param = BAD[case]
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **fields}
    resp = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=PATIENCE)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["message"], err
    assert re.search(r"\S", err["message"])


def test_a_call_and_its_result_round_trip_into_the_next_turn(client: openai.OpenAI, base_url: str) -> None:
    """An agent loop: the reply's message object goes back as it is (the SDK adds refusal, annotations
    and the like), then the tool's result; the next turn's prompt holds both, in DSML and as a result."""
    tools = [tool("first", SCHEMAS["enums and bounded integers"])]
    reply = chat(client, tools=tools, tool_choice="required", parallel_tool_calls=False)
    message = reply.choices[0].message
    call = message.tool_calls[0]
    history = [*ASK, message, {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 °C"}]
    follow_up = chat(client, messages=history, tools=tools, max_tokens=4)
    assert follow_up.choices[0].finish_reason in ("length", "stop", "tool_calls")
    sent = [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m for m in history]
    prompt = httpx.post(base_url + "/tokenize", json={"messages": sent}, timeout=PATIENCE).json()
    text = httpx.post(base_url + "/detokenize", json={"tokens": prompt["tokens"]}, timeout=PATIENCE).json()["prompt"]
    args = json.loads(call.function.arguments)
    assert 'invoke name="first"' in text and "<tool_result>sunny, 21 °C</tool_result>" in text
    assert f'string="true">{args["city"]}</' in text and f'string="false">{args["days"]}</' in text
    assert follow_up.usage.prompt_tokens > prompt["count"]  # plus the tools block in the system prompt


def test_a_forced_call_cut_off_by_max_tokens_is_a_call_and_never_markup(client: openai.OpenAI) -> None:
    """Byte-sized tokens here (a call is ~150): six cuts spread over it; tests/test_structured_real_tokenizer.py
    cuts V4's own tokens, at every one on the text side."""
    tools = [tool("first", SCHEMAS["enums and bounded integers"])]
    assert_cut_calls(lambda **kw: chat(client, **kw), tools, "first", lambda n: range(1, n, n // 4), streamed_every=2)


def assert_cut_calls(ask: Any, tools: list[dict[str, Any]], name: str, cuts: Callable[[int], Iterable[int]],
                     streamed_every: int) -> None:
    """The whole forced call, then the same request cut by max_tokens at each of `cuts(its tokens)`: the reply is the
    call so far (its arguments a prefix of the whole call's, a character cut in two aside; no call before
    its name is complete, one from then on) with finish_reason "length", streamed alike, and never any
    content (no DSML markup, not even the line breaks before the block)."""
    choice = {"type": "function", "function": {"name": name}}
    reply = ask(tools=tools, tool_choice=choice)
    whole = reply.choices[0].message.tool_calls[0].function.arguments
    named_at = None
    for i, cut in enumerate(cuts(reply.usage.completion_tokens)):
        c = ask(tools=tools, tool_choice=choice, max_tokens=cut).choices[0]
        assert c.finish_reason == "length" and not c.message.content, (cut, c.message.content)
        calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls or []]
        if calls:
            named_at = named_at or cut
            assert len(calls) == 1 and calls[0]["name"] == name, (cut, calls)
            assert whole.startswith(calls[0]["arguments"]), (cut, calls, whole)
        assert (named_at is not None) == bool(calls), cut  # once named, it stays a call
        if i % streamed_every == 0:
            streamed, finish, content = streamed_calls_of(ask, tools=tools, tool_choice=choice, max_tokens=cut)
            assert (streamed, finish, content) == (calls, "length", ""), cut
    assert named_at is not None


def streamed_calls_of(ask: Any, **kwargs: Any) -> tuple[list[dict[str, str]], str | None, str]:
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in ask(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.id is not None:  # the first delta of a call carries its id, type and name
                    assert d.type == "function" and d.function.name and d.index not in calls
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def test_tools_with_a_response_format(client: openai.OpenAI, base_url: str) -> None:
    """What an agent with tools and an output type sends: under `required` the reply is a call; under
    `auto` it is a call or the formatted answer, whichever the model starts (steered here by a bias on
    the first character of each: `{` or the line break before a call block)."""
    schema = SCHEMAS["enums and bounded integers"]
    tools = [tool("first", schema)]
    answer = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMAS["nested object"]}}
    forced = chat(client, tools=tools, tool_choice="required", response_format=answer, parallel_tool_calls=False)
    forced = forced.choices[0]
    assert forced.finish_reason == "tool_calls" and forced.message.content is None
    jsonschema.validate(json.loads(forced.message.tool_calls[0].function.arguments), schema)

    def first_token(text: str) -> str:
        ids = httpx.post(base_url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                         timeout=PATIENCE).json()["tokens"]
        return str(ids[0])

    as_answer = chat(client, tools=tools, response_format=answer, extra_body={"logit_bias": {first_token("{"): 30}})
    c = as_answer.choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    jsonschema.validate(json.loads(c.message.content), SCHEMAS["nested object"])
    as_call = chat(client, tools=tools, response_format=answer, parallel_tool_calls=False,
                   extra_body={"logit_bias": {first_token("\n"): 30}})
    c = as_call.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), schema)
