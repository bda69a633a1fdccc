"""DeepSeek-V4 prompt encoding tests.

Expected prompts are written out by hand from the documented V4 format, with the special tokens
spelled by code point here rather than imported from the module under test.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from v4serve.server.text import chat_encoding as ce
from v4serve.server.text.chat_encoding import encode_messages
from v4serve.server.text.tokenizer import ByteTokenizer

BAR = "\uff5c"
SP = "\u2581"
BOS = f"<{BAR}begin{SP}of{SP}sentence{BAR}>"
EOS = f"<{BAR}end{SP}of{SP}sentence{BAR}>"
USER = f"<{BAR}User{BAR}>"
ASSISTANT = f"<{BAR}Assistant{BAR}>"
DSML = f"{BAR}DSML{BAR}"

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATION: list[dict[str, Any]] = [
    SYSTEM,
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
    {"role": "user", "content": "Thanks"},
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

# The tool instructions block of the V4 format, written out as documented.
TOOLS_BLOCK = (
    """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501
)


def test_token_spellings() -> None:
    assert (ce.BOS, ce.EOS, ce.USER, ce.ASSISTANT, ce.DSML) == (BOS, EOS, USER, ASSISTANT, DSML)
    assert (ce.THINK_START, ce.THINK_END) == ("<think>", "</think>")
    assert "|" not in TOOLS_BLOCK.replace("true|false", "")  # the hand-written block uses ｜ too


# --- exact prompts ------------------------------------------------------------------------------


def test_chat_mode_multi_turn_exact() -> None:
    expected = (
        BOS + "You are terse."
        + USER + "Hi" + ASSISTANT + "</think>" + "Hello!" + EOS
        + USER + "2+2?" + ASSISTANT + "</think>" + "4" + EOS
        + USER + "Thanks" + ASSISTANT + "</think>"
    )
    assert encode_messages(CONVERSATION, thinking=False) == expected


def test_thinking_mode_multi_turn_exact() -> None:
    # Earlier turns lose their reasoning and get the chat-mode header; only the open turn thinks.
    expected = (
        BOS + "You are terse."
        + USER + "Hi" + ASSISTANT + "</think>" + "Hello!" + EOS
        + USER + "2+2?" + ASSISTANT + "</think>" + "4" + EOS
        + USER + "Thanks" + ASSISTANT + "<think>"
    )
    prompt = encode_messages(CONVERSATION, thinking=True)
    assert prompt == expected
    assert "Greet back." not in prompt and "Simple sum." not in prompt


def test_thinking_mode_keeps_reasoning_after_last_user_in_a_finished_exchange() -> None:
    # DeepSeek's encoding's "thinking without tools" case: the conversation as it stands, no generation prompt.
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello"},
        {
            "role": "assistant",
            "reasoning_content": "The user said hello, I should greet back.",
            "content": "Hi there! How can I help you?",
        },
        {"role": "user", "content": "What is the capital of France?"},
        {
            "role": "assistant",
            "reasoning_content": "The user asks about the capital of France. It is Paris.",
            "content": "The capital of France is Paris.",
        },
    ]
    expected = (
        BOS + "You are a helpful assistant."
        + USER + "Hello" + ASSISTANT + "</think>Hi there! How can I help you?" + EOS
        + USER + "What is the capital of France?" + ASSISTANT
        + "<think>The user asks about the capital of France. It is Paris.</think>"
        + "The capital of France is Paris." + EOS
    )
    assert encode_messages(messages, thinking=True, add_generation_prompt=False) == expected
    # Asked for an answer after it (DeepSeek's converter): the request's assistant turns are history, their
    # reasoning dropped, and the generation prompt follows the last one.
    asked = expected.replace("<think>The user asks about the capital of France. It is Paris.</think>", "</think>")
    assert encode_messages(messages, thinking=True) == asked + ASSISTANT + "<think>"


def test_without_system_and_without_generation_prompt() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert encode_messages(messages) == BOS + USER + "Hi" + ASSISTANT + "</think>"
    assert encode_messages(messages, thinking=True) == BOS + USER + "Hi" + ASSISTANT + "<think>"
    assert encode_messages(messages, add_generation_prompt=False) == BOS + USER + "Hi"


def test_chat_mode_ignores_reasoning_content() -> None:
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    finished = BOS + USER + "Q" + ASSISTANT + "</think>A" + EOS
    assert encode_messages(messages, add_generation_prompt=False) == finished
    assert encode_messages(messages) == finished + ASSISTANT + "</think>"


def test_an_assistant_prefix_is_continued_open() -> None:
    """DeepSeek's chat prefix completion: the last assistant message, `prefix: true`, stays open."""
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Def", "prefix": True}]
    assert encode_messages(messages) == BOS + USER + "Q" + ASSISTANT + "</think>Def"
    with_reasoning = [messages[0], {**messages[1], "reasoning_content": "R"}]
    assert encode_messages(with_reasoning, thinking=True) == BOS + USER + "Q" + ASSISTANT + "<think>R</think>Def"
    with pytest.raises(ValueError, match="only the last message"):
        encode_messages([messages[1], messages[0]])


def test_every_system_message_goes_to_the_head() -> None:
    messages = [{"role": "system", "content": "One."}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"}, {"role": "system", "content": "Two."},
                {"role": "user", "content": "R"}]
    assert encode_messages(messages) == (BOS + "One.\n\nTwo." + USER + "Q" + ASSISTANT + "</think>A" + EOS
                                         + USER + "R" + ASSISTANT + "</think>")


def test_response_formats_in_the_head() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    messages = [{"role": "system", "content": "S."}, {"role": "user", "content": "Q json"}]
    assert encode_messages(messages, response_format={"type": "json_schema", "json_schema": {"schema": schema}}) == (
        BOS + "S.\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        + json.dumps(schema) + USER + "Q json" + ASSISTANT + "</think>")
    assert encode_messages(messages, response_format={"type": "json_object"}) == (
        BOS + "S.\n\nYou are a helpful assistant designed to output JSON.\n## Response Format:\n\n"
        "Reply with JSON object ONLY." + USER + "Q json" + ASSISTANT + "</think>")
    assert encode_messages(messages, response_format={"type": "text"}) == encode_messages(messages)
    with pytest.raises(ValueError, match="the word 'json'"):
        encode_messages([{"role": "user", "content": "Q"}], response_format={"type": "json_object"})


def test_an_image_is_unsupported_in_v4() -> None:
    parts = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]
    assert encode_messages([{"role": "user", "content": parts}]) == (
        BOS + USER + "see\n\n[Unsupported Image]" + ASSISTANT + "</think>")


def test_a_call_without_arguments_has_no_parameter_lines() -> None:
    call = {"id": "x", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    assert encode_messages(messages, add_generation_prompt=False).endswith(
        f"</think>\n\n<{DSML}tool_calls>\n<{DSML}invoke name=\"now\">\n</{DSML}invoke>\n</{DSML}tool_calls>" + EOS)


def test_tool_calls_and_results_exact_chat_mode() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {
                    "id": "b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'},
                },
            ],
        },
        # Results arrive out of call order and are followed by more user text: one user turn.
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
        {"role": "tool", "tool_call_id": "a", "content": "sun"},
        {"role": "user", "content": "Summarise."},
    ]
    expected = (
        BOS + "S\n\n" + TOOLS_BLOCK
        + USER + "Weather in Paris and Rome?" + ASSISTANT + "</think>"
        + "\n\n<｜DSML｜tool_calls>\n"
        + '<｜DSML｜invoke name="get_weather">\n'
        + '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        + "</｜DSML｜invoke>\n"
        + '<｜DSML｜invoke name="get_weather">\n'
        + '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
        + '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
        + "</｜DSML｜invoke>\n"
        + "</｜DSML｜tool_calls>" + EOS
        + USER + "<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>\n\nSummarise."
        + ASSISTANT + "</think>"
    )
    assert encode_messages(messages, tools=[WEATHER_TOOL]) == expected


def test_tools_on_system_message_equal_request_tools() -> None:
    with_key = [{"role": "system", "content": "S", "tools": [WEATHER_TOOL]}, {"role": "user", "content": "Q"}]
    via_arg = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert encode_messages(with_key) == encode_messages(via_arg, tools=[WEATHER_TOOL])


def test_request_tools_without_system_add_empty_system() -> None:
    prompt = encode_messages([{"role": "user", "content": "Q"}], tools=[WEATHER_TOOL])
    assert prompt == BOS + "\n\n" + TOOLS_BLOCK + USER + "Q" + ASSISTANT + "</think>"


def test_thinking_with_tools_keeps_all_reasoning() -> None:
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
    ]
    expected = (
        BOS + "\n\n" + TOOLS_BLOCK
        + USER + "Q1" + ASSISTANT + "<think>R1</think>A1" + EOS
        + USER + "Q2" + ASSISTANT + "<think>"
    )
    assert encode_messages(messages, thinking=True, tools=[WEATHER_TOOL]) == expected


def test_thinking_with_drop_disabled_keeps_reasoning() -> None:
    prompt = encode_messages(CONVERSATION, thinking=True, drop_thinking=False)
    assert USER + "Hi" + ASSISTANT + "<think>Greet back.</think>Hello!" + EOS in prompt


def test_developer_and_latest_reminder_roles() -> None:
    messages = [
        {"role": "developer", "content": "Dev rules"},
        {"role": "user", "content": "Q"},
        {"role": "latest_reminder", "content": "Today is Monday."},
    ]
    expected = (
        BOS + USER + "Dev rules" + USER + "Q" + f"<{BAR}latest_reminder{BAR}>Today is Monday."
        + ASSISTANT + "</think>"
    )
    assert encode_messages(messages) == expected
    # In thinking mode a developer message before the last user message is dropped.
    dropped = encode_messages(messages, thinking=True)
    assert dropped == BOS + USER + "Q" + f"<{BAR}latest_reminder{BAR}>Today is Monday." + ASSISTANT + "<think>"


def test_content_part_lists() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert encode_messages([{"role": "user", "content": parts}]) == BOS + USER + "one\n\ntwo" + ASSISTANT + "</think>"


def test_reasoning_effort_prefixes_only_in_thinking_mode() -> None:
    messages = [{"role": "user", "content": "Q"}]
    high = encode_messages(messages, thinking=True, reasoning_effort="high")
    assert high.startswith(BOS + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert high.endswith("is left unchecked.\n\n" + USER + "Q" + ASSISTANT + "<think>")
    top = encode_messages(messages, thinking=True, reasoning_effort="max")
    assert top.startswith(BOS + "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n")
    assert top.endswith("no error remains undiscovered.\n\n" + USER + "Q" + ASSISTANT + "<think>")
    assert encode_messages(messages, thinking=True, reasoning_effort="low") == encode_messages(messages, thinking=True)
    assert encode_messages(messages, reasoning_effort="max") == encode_messages(messages)


# --- prefix stability ---------------------------------------------------------------------------


def _assert_prefix_stable(turns: list[list[dict[str, Any]]], thinking: bool, **kwargs: Any) -> None:
    """Each request's prompt plus the model's answer must be a prefix of the next request."""
    history: list[dict[str, Any]] = []
    for new_messages in turns:
        *asked, answer = new_messages
        history.extend(asked)
        prompt = encode_messages(history, thinking=thinking, **kwargs)
        reasoning = answer.get("reasoning_content", "") + "</think>" if thinking else ""
        alone = encode_messages([answer], thinking=False, add_generation_prompt=False)
        calls = alone.removeprefix(BOS + ASSISTANT + "</think>")
        completion = reasoning + calls  # content + DSML block + EOS, exactly as generated
        history.append(answer)
        finished = encode_messages(history, thinking=thinking, add_generation_prompt=False, **kwargs)
        assert finished == prompt + completion
        nxt = encode_messages([*history, {"role": "user", "content": "next"}], thinking=thinking, **kwargs)
        assert nxt.startswith(finished)


TURNS: list[list[dict[str, Any]]] = [
    [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "r1"}],
    [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "r2",
            "tool_calls": [{"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
        },
    ],
    [{"role": "tool", "tool_call_id": "x", "content": "sun"}, {"role": "assistant", "content": "Sunny."}],
    [{"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Bye", "reasoning_content": "r4"}],
]


def test_chat_mode_is_prefix_stable() -> None:
    _assert_prefix_stable(TURNS, thinking=False)
    _assert_prefix_stable(TURNS, thinking=False, tools=[WEATHER_TOOL])


def test_thinking_mode_with_tools_is_prefix_stable() -> None:
    _assert_prefix_stable(TURNS, thinking=True, tools=[WEATHER_TOOL])


def test_thinking_mode_without_tools_breaks_prefix() -> None:
    first = encode_messages(CONVERSATION[:2], thinking=True)
    second = encode_messages(CONVERSATION[:4], thinking=True)
    assert first.endswith("<think>")
    assert not second.startswith(first)
    assert second.startswith(first[: -len("<think>")] + "</think>")


def test_chat_mode_prefix_stable_turn_by_turn() -> None:
    for k in range(1, len(CONVERSATION)):
        as_it_stands = encode_messages(CONVERSATION[:k], add_generation_prompt=False)
        assert encode_messages(CONVERSATION[: k + 1]).startswith(as_it_stands)


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        {"role": "function", "content": "x"},
        {"role": "ipython", "content": "x"},
        {"content": "no role"},
        {"role": None, "content": "x"},
    ],
)
def test_unsupported_role_raises(message: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="role"):
        encode_messages([{"role": "user", "content": "Q"}, message])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "empty"),
        (["not a dict"], "object"),
        ([{"role": "developer", "content": ""}], "developer"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}], "input_audio"),
        ([{"role": "user", "content": 42}], "string"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}], "name"),
        ([{"role": "assistant", "content": "", "reasoning_content": 5}], "reasoning_content"),
    ],
)
def test_invalid_messages_raise(messages: list[Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_messages(messages)


def test_invalid_reasoning_effort_raises() -> None:
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages([{"role": "user", "content": "Q"}], reasoning_effort="extreme")
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages([{"role": "user", "content": "Q"}], reasoning_effort="medium")  # the request's: mapped first


def test_input_messages_not_mutated() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    snapshot = json.dumps(messages)
    encode_messages(messages, thinking=True, tools=[WEATHER_TOOL])
    assert json.dumps(messages) == snapshot


# --- with the tokenizer -------------------------------------------------------------------------


def test_prompt_tokenizes_markers_as_special_ids() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(encode_messages(CONVERSATION[:2], thinking=True))
    assert ids[0] == tok.bos_token_id
    assert ids[-3:] == tok.encode(USER + "Hi" + ASSISTANT + "<think>")[-3:]
    assert ids[-2:] == [4, 5]
    assert tok.decode(ids) == encode_messages(CONVERSATION[:2], thinking=True)
