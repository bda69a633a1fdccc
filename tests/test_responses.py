"""OpenAI's Responses API (`/v1/responses`) through the openai SDK and the OpenAI Agents SDK against a
real daemon (the tiny model): replies and their typed stream events, tools, structured output,
stored responses and `previous_response_id` resuming from the cache."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.daemon import PATIENCE, daemon

MODEL = "v4serve-tiny"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Zürich"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather", "parameters": WEATHER}]
DOCUMENT = "A long shared document. " + " ".join(f"Section {i} says {i * 7 % 13}." for i in range(40))


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with daemon() as served:
        yield served


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=url + "/v1", api_key="key-a", max_retries=0, timeout=PATIENCE) as c:
        yield c


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.responses.create(**{"model": MODEL, "temperature": 0, "max_output_tokens": 12, **kwargs})


def test_a_response_and_its_events_in_order(client: openai.OpenAI) -> None:
    reply = create(client, input="Hello there", instructions="Be brief.")
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == MODEL
    assert reply.status in ("completed", "incomplete") and [i.type for i in reply.output] == ["message"]
    assert reply.usage.input_tokens > 0 and reply.usage.output_tokens <= 12
    assert reply.usage.output_tokens_details.reasoning_tokens == 0
    events = list(create(client, input="Hello there", instructions="Be brief.", stream=True))
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed" if reply.status == "completed" else "response.incomplete"]
    assert kinds[:4] == head and kinds[-4:] == tail and set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    assert events[-1].response.output_text == reply.output_text
    # The SDK's stream helper wants `response.completed` (a cut-off stream ends `response.incomplete`):
    # a bounded JSON answer ends by itself.
    small = {"format": {"type": "json_schema", "name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
        "additionalProperties": False}}}
    whole = create(client, input="A number?", text=small, max_output_tokens=40)
    with client.responses.stream(model=MODEL, temperature=0, max_output_tokens=40, input="A number?",
                                 text=small) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        assert "".join(deltas) == stream.get_final_response().output_text == whole.output_text
    assert whole.status == "completed" and json.loads(whole.output_text)["n"] in range(10)


def test_stored_responses_resume_from_the_cache(client: openai.OpenAI, url: str) -> None:
    """A follow-up sends only its new message: its prompt is the first response's prompt and output,
    token for token, then the new turn, so everything before the new turn is a cache hit."""
    first = create(client, input=DOCUMENT, max_output_tokens=9)
    second = create(client, input="And section 3?", previous_response_id=first.id)
    before = first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id and second.usage.input_tokens > before
    assert second.usage.input_tokens_details.cached_tokens == before - 1  # the last output token's KV: never computed
    httpx.post(url + "/reset_prefix_cache", timeout=PATIENCE).raise_for_status()  # no store here: all cold
    cold = create(client, input="And section 3?", previous_response_id=first.id)
    assert cold.usage.input_tokens_details.cached_tokens == 0 and cold.usage.input_tokens == second.usage.input_tokens
    assert cold.output_text == second.output_text  # the hit changed nothing: the cold run's greedy tokens
    whole = create(client, input=[{"role": "user", "content": DOCUMENT},
                                  {"role": "assistant", "content": first.output_text},
                                  {"role": "user", "content": "And section 3?"}])
    assert whole.usage.input_tokens > 0  # the same conversation, rendered whole, is served too
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with openai.OpenAI(base_url=url + "/v1", api_key="key-b", max_retries=0) as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(first.id)  # another key's responses are not there
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        create(client, input="x", previous_response_id=second.id)
    unstored = create(client, input="not kept", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_forced_call_its_output_and_a_cut_off_call(client: openai.OpenAI) -> None:
    call = create(client, input="Weather in Paris?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_output_tokens=300)
    (item,) = call.output
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    jsonschema.validate(json.loads(item.arguments), WEATHER)
    follow = create(client, previous_response_id=call.id, tools=TOOLS, parallel_tool_calls=False,
                    input=[{"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}])
    assert follow.usage.input_tokens_details.cached_tokens > 0
    streamed = list(create(client, input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                           parallel_tool_calls=False, max_output_tokens=300, stream=True))
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in streamed if e.type == "response.output_item.done").item
    assert (done.name, done.arguments) == (item.name, item.arguments)
    cut = create(client, input="Weather in Paris?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                 max_output_tokens=call.usage.output_tokens - 8)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert [(i.type, i.status) for i in cut.output] == [("function_call", "incomplete")]
    assert item.arguments.startswith(cut.output[0].arguments) and not cut.output_text


class Verdict(BaseModel):
    ok: bool
    score: int = Field(ge=0, le=9)


def test_parse_and_text_format(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model=MODEL, input="Judge this.", text_format=Verdict, temperature=0,
                                    max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Verdict)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    raw = create(client, input="JSON please", text={"format": {"type": "json_schema", "name": "n", "schema": schema}},
                 max_output_tokens=40)
    jsonschema.validate(json.loads(raw.output_text), schema)


def test_reasoning_effort_turns_thinking_on(client: openai.OpenAI) -> None:
    thought = create(client, input="Think.", reasoning={"effort": "high"})
    assert thought.output[0].type == "reasoning" and thought.usage.output_tokens_details.reasoning_tokens > 0
    assert thought.output[0].content[0].text
    plain = create(client, input="Think.", reasoning={"effort": "none"})
    assert all(i.type != "reasoning" for i in plain.output)


@pytest.mark.parametrize("fields, param", [
    ({"truncation": "auto"}, "truncation"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
])
def test_bad_requests_are_400s_naming_the_field(url: str, fields: dict, param: str) -> None:
    got = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "x", **fields}, timeout=PATIENCE)
    assert got.status_code == 400 and got.json()["error"]["param"].split(".")[0] == param, got.text


def test_an_agent_runs_on_its_default_responses_model(url: str) -> None:
    """The OpenAI Agents SDK, unmodified: an agent with a function tool and an output type. Its first
    turn must call (tool_choice required), the SDK runs the tool and asks again with tool_choice reset
    to auto, and the reply (a call or the typed answer, one grammar) is the answer: the run finishes."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: Literal["Paris", "Zürich"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="key-a", max_retries=0) as client:
            agent = Agent(name="forecaster", instructions="Use the tool, then judge.", tools=[get_weather],
                          model=OpenAIResponsesModel(MODEL, client), output_type=Verdict,
                          model_settings=ModelSettings(temperature=0, max_tokens=400, tool_choice="required",
                                                       parallel_tool_calls=False))
            return await Runner.run(agent, "Weather, then a verdict?", max_turns=4)

    result = asyncio.run(run())
    assert isinstance(result.final_output, Verdict)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert result.new_items[1].output.startswith("sunny in ")


def test_streamed_reasoning_and_a_failure_mid_stream(client: openai.OpenAI) -> None:
    """Thinking streams as `response.reasoning_text.*` events in a reasoning item; a generation that
    fails after the stream began (here a schema the grammar engine gives up on after the first token)
    ends with `response.failed` naming the cause."""
    events = list(create(client, input="Think.", reasoning={"effort": "high"}, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "reasoning"
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") != ""
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    failing = list(create(client, input="x", stream=True,
                          text={"format": {"type": "json_schema", "name": "e", "schema": endless}}))
    assert failing[-1].type == "response.failed" and failing[-1].response.status == "failed"
    assert "the grammar engine cannot continue" in failing[-1].response.error.message


def test_stored_responses_are_bounded_least_recently_used_first() -> None:
    from array import array

    from v4serve.server.errors import ApiError
    from v4serve.server.responses import StoredResponse, StoredResponses

    def one(tokens: int, owner: str = "a") -> StoredResponse:
        return StoredResponse({}, owner, [], (), array("i", range(tokens)))

    kept = StoredResponses(max_responses=3, max_tokens=100)
    for name in ("r1", "r2", "r3"):
        kept.put(name, one(10))
    kept.get("r1", "a")  # used: r2 is now the least recent
    kept.put("r4", one(10))
    with pytest.raises(ApiError):
        kept.get("r2", "a")
    assert [kept.get(n, "a") is not None for n in ("r1", "r3", "r4")] == [True] * 3
    kept.put("big", one(80))  # 110 tokens: the least recent go until 100 or fewer remain
    with pytest.raises(ApiError):
        kept.get("r1", "a")
    kept.get("big", "a")
    with pytest.raises(ApiError):
        kept.get("big", "b")  # another key's
    kept.delete("big", "a")
    with pytest.raises(ApiError):
        kept.get("big", "a")
