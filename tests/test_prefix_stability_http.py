"""An agent's conversation, turn after turn over HTTP, in chat mode and in thinking mode with tools: each turn's
prompt (the render endpoint's ids) begins with the previous turn's prompt token for token (its earlier turns
re-rendered byte for byte, its generation prompt the way the assistant turn opens), and the request is a
prefix-cache hit for at least every block of that earlier prompt (`cached_tokens`), on Chat Completions and
on Anthropic Messages alike, in DeepSeek-V4's format (`tiny`) and V4.1's (`tiny-v41`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.daemon import PATIENCE, start_daemon

BLOCK = 128  # the embedded model's block: prefix hits come in whole blocks (or a turn's exact end)
DOC = "A long document the agent was given to read. " * 12  # a few blocks of prompt
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module", params=[("tiny", False), ("tiny", True), ("tiny-v41", False), ("tiny-v41", True)],
                ids=["chat-mode", "thinking", "v41-chat-mode", "v41-thinking"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, bool, str]]:
    model, thinking = request.param
    daemon = start_daemon("--model", model, "--default-chat-template-kwargs", json.dumps({"thinking": thinking}))
    try:
        yield daemon.url, thinking, f"v4serve-{model}"
    finally:
        daemon.stop()


def held_prefix(earlier: list[int], prompt: list[int], cached: int) -> None:
    assert prompt[:len(earlier)] == earlier  # the earlier turns, re-rendered token for token
    assert cached >= len(earlier) // BLOCK * BLOCK > 0, (cached, len(earlier))


def test_a_chat_agent_conversation_stays_a_prefix_hit_turn_after_turn(served: tuple[str, bool, str]) -> None:
    url, thinking, model = served
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                      {"role": "user", "content": DOC + "What is the weather in Paris?"}]
    earlier: list[int] = []
    with httpx.Client(base_url=url, timeout=PATIENCE) as client:
        for turn in range(4):
            body = {"model": model, "messages": messages, "tools": [WEATHER], "max_tokens": 96,
                    "temperature": 0, "tool_choice": "required" if turn % 2 == 0 else "auto"}
            prompt = client.post("/v1/chat/completions/render", json=body).json()["prompt_token_ids"]
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            answer = reply.json()
            if earlier:
                held_prefix(earlier, prompt, answer["usage"]["prompt_tokens_details"]["cached_tokens"])
            earlier = prompt
            message = answer["choices"][0]["message"]
            messages.append({k: v for k, v in message.items() if k in ("role", "content", "reasoning_content",
                                                                        "tool_calls") and v is not None})
            calls = message.get("tool_calls") or []
            assert calls or turn % 2 == 1 or thinking  # a required call (chat mode opens the block for it)
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": "sunny"} for c in calls]
            if not calls:
                messages.append({"role": "user", "content": "And tomorrow?"})


def test_a_messages_agent_conversation_stays_a_prefix_hit_turn_after_turn(served: tuple[str, bool, str]) -> None:
    url, thinking, model = served
    tool = {"name": "get_weather", "description": "Current weather",
            "input_schema": WEATHER["function"]["parameters"]}
    messages: list[dict[str, Any]] = [{"role": "user", "content": DOC + "What is the weather in Paris?"}]
    earlier = 0  # the previous turn's prompt length
    with httpx.Client(base_url=url, timeout=PATIENCE) as client:
        for turn in range(3):
            body = {"model": model, "max_tokens": 12, "temperature": 0, "system": "You are an agent.",
                    "messages": messages, "tools": [tool]}
            counted = client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
            reply = client.post("/v1/messages", json=body)
            assert reply.status_code == 200, reply.text
            answer = reply.json()
            assert answer["usage"]["input_tokens"] + answer["usage"].get("cache_read_input_tokens", 0) == counted
            cached = answer["usage"].get("cache_read_input_tokens", 0)
            if earlier:
                assert cached >= earlier // BLOCK * BLOCK > 0, (turn, cached)
            earlier = counted
            blocks = [b for b in answer["content"] if b["type"] != "thinking" or b.get("thinking")]
            messages.append({"role": "assistant", "content": blocks or [{"type": "text", "text": "ok"}]})
            uses = [b for b in blocks if b["type"] == "tool_use"]
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b["id"],
                                                          "content": "sunny"} for b in uses]
                             or "And tomorrow?"})
