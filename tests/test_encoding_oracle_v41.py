"""DeepSeek's converter as the oracle of v4serve's DeepSeek-V4.1 prompt format (`DeepseekV41Encoding`): the same
corpora as tests/test_encoding_oracle.py (Chat Completions, Messages, Responses), rendered by v4serve for a
checkpoint whose config says `deepseek_v41` and by the converter for `DeepSeek-V4.1-Flash`: prompt strings equal,
and the special tokens where the converter puts them (its special ranges). No V4.1 tokenizer installs here
(DeepSeek ships it with the weights), so ids are not compared; a checkpoint whose tokenizer lacks a V4.1 special
is refused at start, naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import deepseek_recipe
import httpx
import pytest

from tests.daemon import PATIENCE, start_daemon
from tests.test_encoding_oracle import CORPUS, MESSAGES, REFUSED, RESPONSES
from v4serve.server import jobs
from v4serve.server import messages as messages_api
from v4serve.server import responses as responses_api
from v4serve.server.errors import ApiError
from v4serve.server.protocol import ChatCompletionRequest
from v4serve.server.serve import ServeConfig, load_front_tokenizer
from v4serve.server.text.chat_encoding import V4, V41, missing_specials, prompt_format_of, render_messages
from v4serve.server.text.tokenizer import ByteTokenizer, HFTokenizer, embedded_tokenizer, write_byte_tokenizer_files
from v4serve.server.tools import plan_tools

MODEL = "DeepSeek-V4.1-Flash"


def v41_tokenizer() -> ByteTokenizer:
    """The embedded tiny-v41's tokenizer: the byte vocabulary (V4.1's specials included) with V4.1's format."""
    return embedded_tokenizer("tiny-v41")


def converted(body: dict[str, Any]) -> Any:
    return deepseek_recipe.ChatCompletionRequest({"model": MODEL, **body}).convert(
        deepseek_recipe.ConversionOptions()).conversation


def theirs(conversation: Any) -> Any:
    return deepseek_recipe.DeepseekV41Encoding().render_conversation(conversation)


def ours(body: dict[str, Any]) -> tuple[str, Any]:
    """The chat path's prompt text (through `jobs.rendered_chat`), and the rendering with its special ranges."""
    request = ChatCompletionRequest.model_validate({"model": "v4serve-tiny", **body})
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    thinking = request.thinking_mode(True)
    options = {"thinking": thinking, "reasoning_effort": request.v4_effort()}
    _, text = jobs.rendered_chat(v41_tokenizer(), messages, request.tools, request.tool_choice,
                                 request.parallel_tool_calls, request.response_format, 1 << 30, **options)
    plan = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls)
    rendered = render_messages(messages, tools=plan.offered, response_format=request.response_format,
                               call_prefill=jobs.prefills_call(plan, options), prompt_format=V41, **options)
    return text, rendered


@pytest.mark.parametrize(("name", "body"), CORPUS, ids=[name for name, _ in CORPUS])
def test_each_chat_request_renders_as_deepseeks_v41_converter_renders_it(name: str, body: dict[str, Any]) -> None:
    expected = theirs(converted(body))
    text, rendered = ours(body)
    assert text == rendered.text == expected.prompt
    assert list(rendered.special_ranges) == [tuple(r) for r in expected.special_ranges]


@pytest.mark.parametrize(("name", "body"), REFUSED, ids=[name for name, _ in REFUSED])
def test_what_the_v41_converter_refuses_is_a_400(name: str, body: dict[str, Any]) -> None:
    with pytest.raises(Exception):  # noqa: B017, PT011 - the converter raises its own errors
        theirs(converted(body))
    with pytest.raises(ApiError) as refused:
        ours(body)
    assert refused.value.status == 400


@pytest.mark.parametrize(("name", "body"), MESSAGES, ids=[name for name, _ in MESSAGES])
def test_each_messages_body_renders_as_deepseeks_v41_converter_renders_it(name: str, body: dict[str, Any]) -> None:
    conversation = deepseek_recipe.MessagesRequest({"model": MODEL, "max_tokens": 1000, **body}).convert(
        deepseek_recipe.ConversionOptions()).conversation
    tokenizer = v41_tokenizer()
    data = json.dumps({"model": "v4serve-tiny", "max_tokens": 1000, **body}).encode()
    ready, _ = messages_api.prepared(tokenizer, data, tokenizer.token_to_id("</think>"), 1 << 30, "accept", True)
    assert tokenizer.decode(list(ready.prompt)) == theirs(conversation).prompt


@pytest.mark.parametrize(("name", "body"), RESPONSES, ids=[name for name, _ in RESPONSES])
def test_each_responses_body_renders_as_deepseeks_v41_converter_renders_it(name: str, body: dict[str, Any]) -> None:
    conversation = deepseek_recipe.ResponsesRequest({"model": MODEL, **body}).convert(
        deepseek_recipe.ConversionOptions()).conversation
    tokenizer = v41_tokenizer()
    data = json.dumps({"model": "v4serve-tiny", **body}).encode()
    ready, _, _ = responses_api.prepared(tokenizer, data, tokenizer.token_to_id("</think>"), 1 << 30, None,
                                         "accept", True)
    assert tokenizer.decode(list(ready.prompt)) == theirs(conversation).prompt


def test_the_format_is_the_checkpoints_and_a_tokenizer_lacking_a_special_it_writes_is_refused(tmp_path) -> None:
    for model_type, fmt in (("deepseek_v4", V4), ("deepseek_v41", V41), (None, V4)):
        folder = tmp_path / str(model_type)
        write_byte_tokenizer_files(folder)
        (folder / "config.json").write_text(json.dumps({"model_type": model_type} if model_type else {}))
        tokenizer = HFTokenizer(folder)
        assert prompt_format_of(tokenizer) is fmt
        if fmt is V4:
            assert missing_specials(tokenizer, fmt) == ([], []) and load_front_tokenizer(ServeConfig(model=str(folder)))
            continue
        assert missing_specials(tokenizer, fmt) == ([], []) and load_front_tokenizer(ServeConfig(model=str(folder)))
        # The same vocabulary without V4.1's two specials (their ids spelled as reserved ones).
        vocabulary = (folder / "tokenizer.json").read_text(encoding="utf-8")
        (folder / "tokenizer.json").write_text(vocabulary.replace("<｜System｜>", "<｜reserved_15｜>")
                                               .replace("<｜image｜>", "<｜reserved_16｜>"), encoding="utf-8")
        assert missing_specials(HFTokenizer(folder), fmt) == (["<｜System｜>"], ["<｜image｜>"])
        with pytest.raises(ValueError, match="has no token '<｜System｜>', which the deepseek_v41 prompt format"):
            load_front_tokenizer(ServeConfig(model=str(folder)))


@pytest.fixture(scope="module")
def thinking_v41() -> Iterator[str]:
    """The embedded tiny-v41 (V4.1's format), with the converter's default (thinking)."""
    served = start_daemon("--model", "tiny-v41", "--default-chat-template-kwargs", '{"thinking": true}')
    try:
        yield served.url
    finally:
        served.stop()


def _ids(rendering: Any) -> list[int]:
    """A converter rendering in the embedded vocabulary: its special ranges as the specials' own ids (V4.1's
    <｜System｜> among them), everything else (special literals in user text included) as text bytes."""
    tokenizer, prompt, ids, at = v41_tokenizer(), rendering.prompt, [], 0
    for start, end in rendering.special_ranges:
        ids += tokenizer.encode_text(prompt[at:start]) + tokenizer.encode(prompt[start:end])
        at = end
    return ids + tokenizer.encode_text(prompt[at:])


def test_over_http_tiny_v41_renders_the_v41_converters_prompts(thinking_v41: str) -> None:
    with httpx.Client(base_url=thinking_v41, timeout=PATIENCE) as client:
        for name, body in CORPUS:
            reply = client.post("/v1/chat/completions/render", json={"model": "v4serve-tiny-v41", **body})
            assert reply.status_code == 200, (name, reply.text)
            expected = theirs(converted(body))
            assert reply.json()["prompt"] == expected.prompt, name
            assert reply.json()["prompt_token_ids"] == _ids(expected), name
        for name, body in REFUSED:
            reply = client.post("/v1/chat/completions/render", json={"model": "v4serve-tiny-v41", **body})
            assert reply.status_code == 400, (name, reply.text)
        counted = client.post("/v1/messages/count_tokens", json={"model": "v4serve-tiny-v41", **MESSAGES[1][1]})
        expected_messages = deepseek_recipe.MessagesRequest({"model": MODEL, **MESSAGES[1][1]}).convert(
            deepseek_recipe.ConversionOptions()).conversation
        assert counted.json()["input_tokens"] == len(_ids(theirs(expected_messages)))

