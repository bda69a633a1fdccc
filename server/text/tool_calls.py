"""DeepSeek-V4's DSML tool calls, parsed out of generated content as it streams.

    text…\n\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

becomes the content "text…" and a call `get_weather` whose OpenAI `arguments` are the JSON string
`{"city": "Paris", "days": 3}`: string="true" values are raw text (JSON-escaped here), the others
JSON copied as written. The rules are those of DeepSeek's own output parser (`deepseek-recipe`'s
StreamProcessor, the oracle of tests/test_parsing_oracle.py):

- the content ends where markup begins (`<｜DSML｜`), its trailing line breaks dropped; a `｜DSML｜`
  that opens no tag is text;
- from there on only markup counts: each invoke tag is a call (the `tool_calls` wrapper may be
  missing), each parameter tag inside it an argument; anything else between them is skipped, and
  nothing after the block's closing tag is read;
- the call's id and name go out as soon as its invoke tag is whole, the arguments in fragments as
  they arrive (a non-streamed reply is the same fragments joined, so both agree exactly). A block
  still open when generation ends (the token limit cut it off) is `truncated`: its calls so far
  stand, the last one with the arguments produced so far, as OpenAI returns a call cut off by
  `max_tokens`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from v4serve.server.text.tokenizer import DSML

BLOCK_OPEN, BLOCK_CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
MARKUP_OPEN = f"<{DSML}"  # where content ends: any tag, not only the block's
# V4 spells the tags `<｜DSML｜invoke ...>`, V4.1 `<｜DSML｜ invoke ...>` (and its block `calls`): both are read.
_INVOKE = re.compile(rf'<{DSML} ?invoke name="([^"\n]*)">')
_PARAM = re.compile(rf'<{DSML} ?parameter name="([^"\n]*)" string="(true|false)">')
_INVOKE_CLOSE, _BLOCK_CLOSE = re.compile(rf"</{DSML} ?invoke>"), re.compile(rf"</{DSML} ?(?:tool_calls|calls)>")
_PARAM_CLOSE = re.compile(rf"</{DSML} ?parameter>")
_PARAM_CLOSES = (f"</{DSML}parameter>", f"</{DSML} parameter>")


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # with the call's first delta
    name: str | None = None  # likewise
    arguments: str = ""  # the next fragment of the JSON arguments


class ToolCallParser:
    def __init__(self, parallel: bool = True, inside_block: bool = False) -> None:
        """`inside_block`: the prompt opened the tool-call block (a forced call): the output starts in it."""
        self.parallel = parallel  # False: only the first call counts
        self.calls = 0  # calls whole (their invoke tag closed)
        self.truncated = False  # generation ended inside a block
        self._state = "markup" if inside_block else "text"  # text | markup | invoke | value | done
        self._buf = ""
        self._out: list[ToolCallDelta] = []
        self._first_param = True
        self._quoted = False  # the value being read is a string="true" one

    @property
    def begun(self) -> int:
        """Calls begun (their invoke tag read): a reply with one ends for `tool_calls`, as DeepSeek's does."""
        return self.calls + (self._state in ("invoke", "value"))

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """More content text → (content that is safe to send, tool-call deltas)."""
        self._buf += text
        return self._run(final=False)

    def finish(self, cut_off: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """End of generation: release held text; an unfinished block is `truncated`."""
        content, deltas = self._run(final=True)
        self.truncated = self._state in ("markup", "invoke", "value")
        return content, deltas

    # ---- the state machine --------------------------------------------------------------------------
    def _run(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content, self._out = "", []
        while True:
            step = getattr(self, f"_{self._state}")(final)
            if step is None:
                return content, self._out
            content += step

    def _text(self, final: bool) -> str | None:
        start = self._buf.find(MARKUP_OPEN)
        if start >= 0:
            text, self._buf, self._state = self._buf[:start].rstrip("\n"), self._buf[start:], "markup"
            return text
        cut = len(self._buf) if final else _sendable(self._buf)
        if cut == 0:
            return None
        text, self._buf = self._buf[:cut], self._buf[cut:]
        return text

    def _markup(self, final: bool) -> str | None:
        """Between calls: the next invoke tag begins one, the block's close ends the markup."""
        found = _next(self._buf, (_INVOKE, _BLOCK_CLOSE))
        if found is None:
            self._buf = _possible_tag(self._buf)
            return None
        match, self._buf = found, self._buf[found.end():]
        if match.re is _BLOCK_CLOSE:
            self._state = "done"
            return ""
        self._emit(ToolCallDelta(self.calls, id=f"call_{uuid.uuid4().hex[:24]}", name=match.group(1)))
        self._state, self._first_param = "invoke", True
        return ""

    def _invoke(self, final: bool) -> str | None:
        """Inside a call: parameter tags, up to its close."""
        found = _next(self._buf, (_PARAM, _INVOKE_CLOSE, _BLOCK_CLOSE))
        if found is None:
            self._buf = _possible_tag(self._buf)
            return None
        match, self._buf = found, self._buf[found.end():]
        if match.re is not _PARAM:
            self._emit(ToolCallDelta(self.calls, arguments="{}" if self._first_param else "}"))
            self.calls += 1
            self._state = "markup" if match.re is _INVOKE_CLOSE else "done"
            return ""
        self._quoted = match.group(2) == "true"
        lead = "{" if self._first_param else ", "
        self._emit(ToolCallDelta(self.calls, arguments=lead + json.dumps(match.group(1)) + ": " + '"' * self._quoted))
        self._state, self._first_param = "value", False
        return ""

    def _value(self, final: bool) -> str | None:
        end = _PARAM_CLOSE.search(self._buf)
        if end is not None:
            value, self._buf = self._buf[:end.start()], self._buf[end.end():]
            self._emit(ToolCallDelta(self.calls, arguments=self._escaped(value) + '"' * self._quoted))
            self._state = "invoke"
            return ""
        keep = max(_held(self._buf, close) for close in _PARAM_CLOSES)
        if len(self._buf) == keep:
            return None
        value, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        self._emit(ToolCallDelta(self.calls, arguments=self._escaped(value)))
        return None

    def _done(self, final: bool) -> str | None:
        self._buf = ""  # past the block nothing is read
        return None

    def _escaped(self, value: str) -> str:
        return json.dumps(value, ensure_ascii=False)[1:-1] if self._quoted else value

    def _emit(self, delta: ToolCallDelta) -> None:
        if self.parallel or delta.index == 0:
            self._out.append(delta)


def _sendable(text: str) -> int:
    """How much of `text` can go out as it is: all but a possible start of markup at its end and the line
    breaks before that (they go with the markup if it comes, so they wait for the next text to decide)."""
    return len(text[:len(text) - _held(text, MARKUP_OPEN)].rstrip("\n"))


def _next(text: str, tags: tuple[re.Pattern[str], ...]) -> re.Match[str] | None:
    """The first of `tags` in `text` (whole), or None."""
    found = [m for m in (tag.search(text) for tag in tags) if m is not None]
    return min(found, key=lambda m: m.start(), default=None)


def _possible_tag(text: str) -> str:
    """What of skipped markup text to keep: from its last `<` on, which may begin a tag still coming."""
    start = text.rfind("<", max(0, len(text) - _LONGEST_TAG))
    return text[start:] if start >= 0 and "\n" not in text[start:] else ""


_LONGEST_TAG = 512  # a tag longer than this (a tool's name is at most 64 characters) is not waited for


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplit:
    """Thinking mode with tools: the reasoning ends where markup begins in it, as DeepSeek's parser reads a
    call the model opened without closing its thinking; the markup and what follows go to the call parser.
    `push` gives (reasoning safe to send, the rest once it has ended); line breaks and a possible start of
    markup are held back until the next text decides them."""

    def __init__(self) -> None:
        self._held = ""
        self.ended = False

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        start = text.find(MARKUP_OPEN)
        if start >= 0:
            self.ended = True
            return text[:start].rstrip("\n"), text[start:]
        cut = len(text) if final else _sendable(text)
        self._held = text[cut:]
        return text[:cut], ""
