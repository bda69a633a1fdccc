"""The preprocessing jobs (`preprocess.Preprocessor.run`): what turns a request's conversation, tools
and schemas into prompt token ids and a grammar, done in a worker process.

Each job takes the tokenizer first and plain data after; what it returns is small or flat (token ids
as an `array`), so neither direction costs the front end more than a copy. A prompt past the context
(`max_len`) is refused here, before its ids travel back.
"""

from __future__ import annotations

import re
from array import array
from dataclasses import dataclass
from typing import Any

from v4serve.engine.request import GrammarSpec
from v4serve.server.errors import ApiError
from v4serve.server.text.chat_encoding import prompt_format_of, render_messages
from v4serve.server.text.tokenizer import encode_rendered
from v4serve.server.tools import ToolPlan, answer_grammar, plan_tools


@dataclass(frozen=True)
class Prepared:
    """A conversation ready for the engine: its prompt and what its tools and format ask of the output."""

    prompt: array  # token ids ("i")
    parse_calls: bool = False  # look for tool calls in the output
    parallel: bool = True  # several calls in one reply
    grammar: GrammarSpec | None = None
    inside_calls: bool = False  # the prompt opened the tool-call block: the output starts inside it


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_containers(_tokenizer: Any, data: bytes) -> int:
    """Objects and arrays in a JSON text: its `{` and `[` outside strings."""
    stripped = _JSON_STRING.sub(b'""', data)
    return stripped.count(b"{") + stripped.count(b"[")


def ids(values: list[int]) -> array:
    return array("i", values)


def check_length(prompt: list[int] | array, max_len: int, param: str) -> None:
    """A prompt that leaves no room for one output token is a 400, as the engine would say."""
    if len(prompt) >= max_len:
        raise ApiError(400, f"This model's maximum context length is {max_len} tokens. However, your {param} "
                            f"resulted in {len(prompt)} tokens. Please reduce the length of the {param}.",
                       param=param, code="context_length_exceeded")


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], max_len: int, param: str = "messages",
                **options: Any) -> array:
    """Token ids of a conversation in DeepSeek-V4's prompt format."""
    options.setdefault("prompt_format", prompt_format_of(tokenizer))
    try:
        rendered = render_messages(messages, **options)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param) from None
    prompt = encode_rendered(tokenizer, rendered.text, rendered.special_ranges)
    check_length(prompt, max_len, param)
    return ids(prompt)


def encode_texts(tokenizer: Any, texts: list[str], add_bos: bool, max_len: int, param: str = "prompt") -> list[array]:
    """Token ids of text prompts (BOS first unless asked not to)."""
    bos = tokenizer.bos_token_id
    out = []
    for text in texts:
        prompt = tokenizer.encode(text)
        if add_bos and prompt[:1] != [bos]:
            prompt.insert(0, bos)
        check_length(prompt, max_len, param)
        out.append(ids(prompt))
    return out


def decode(tokenizer: Any, tokens: list[int] | array, skip_special_tokens: bool = False) -> str:
    return tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)


def decode_all(tokenizer: Any, prompts: list[list[int]]) -> list[str]:
    return [decode(tokenizer, p) for p in prompts]


def rendered_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None, tool_choice: Any,
                  parallel_tool_calls: bool | None, response_format: Any, max_len: int, **options: Any
                  ) -> tuple[array, str]:
    """A render endpoint's conversation: its ids and their text."""
    plan = plan_tools(tools, tool_choice, parallel_tool_calls)
    prompt = encode_chat(tokenizer, messages, max_len, tools=plan.offered, response_format=response_format,
                         call_prefill=prefills_call(plan, options), **options)
    return prompt, decode(tokenizer, prompt)


def prefills_call(plan: ToolPlan, options: dict[str, Any]) -> bool:
    """A forced call in chat mode: the prompt opens its block (in thinking mode the reasoning comes first)."""
    return plan.forced is not None and not options.get("thinking")


def rendered_texts(tokenizer: Any, texts: list[str], max_len: int) -> list[tuple[array, str]]:
    return [(p, decode(tokenizer, p)) for p in encode_texts(tokenizer, texts, True, max_len)]


def chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None, tool_choice: Any,
         parallel_tool_calls: bool | None, response_format: Any, think_end: int | None, max_len: int,
         param: str = "messages", **options: Any) -> Prepared:
    """A chat request's tools checked, its answer's grammar built and its conversation tokenized."""
    plan = plan_tools(tools, tool_choice, parallel_tool_calls)
    prefill = prefills_call(plan, options)
    grammar = answer_grammar(plan, response_format, think_end, prefill)
    prompt = encode_chat(tokenizer, messages, max_len, param, tools=plan.offered, response_format=response_format,
                         call_prefill=prefill, **options)
    return Prepared(prompt, plan.parse_calls, plan.parallel, grammar, prefill)


def continuation(tokenizer: Any, before: list[dict[str, Any]], new: list[dict[str, Any]], earlier: array,
                 max_len: int, **options: Any) -> array | None:
    """A stored conversation's tokens (`earlier`) followed by what the new turns add to its rendering:
    the engine resumes where the stored response ended (None when the new turns do not only add to
    its end)."""
    options.setdefault("prompt_format", prompt_format_of(tokenizer))
    try:
        done = render_messages(before, add_generation_prompt=False, drop_thinking=False, **options)
        more = render_messages(before + new, drop_thinking=False, **options)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="input") from None
    if not more.extends(done):
        return None
    added = more.after(len(done.text))
    prompt = earlier + ids(encode_rendered(tokenizer, added.text, added.special_ranges))
    check_length(prompt, max_len, "input")
    return prompt
