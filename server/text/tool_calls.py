"""DeepSeek-V4's DSML tool calls, parsed out of generated content as it streams.

    text…\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

becomes the content "text…" and a call `get_weather` whose OpenAI `arguments` are the JSON string
`{"city": "Paris", "days": 3}`: string="true" values are raw text (JSON-escaped here), the others
JSON copied as written. The parser emits the call's id and name as soon as its invoke tag is
complete and the arguments in fragments as they arrive, and never lets markup into the content (a
possible partial tag is held back until the next text decides it). A non-streamed reply is the same
fragments joined, so both agree exactly. A block still open when generation ends (the token limit
cut it off) is `truncated`: its calls so far stand, the last one with the arguments produced so far,
as OpenAI returns a call cut off by `max_tokens`. Text that opens a block but is not DSML after all
is content without its DSML tags: no markup ever reaches a client's text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from v4serve.server.text.tokenizer import DSML

BLOCK_OPEN, BLOCK_CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
INVOKE_CLOSE, PARAM_CLOSE = f"</{DSML}invoke>", f"</{DSML}parameter>"
_INVOKE = re.compile(rf'<{DSML}invoke name="([^"\n]*)">')
_PARAM = re.compile(rf'<{DSML}parameter name="([^"\n]*)" string="(true|false)">')
_SEPARATOR = "\n\n"  # what the chat encoding puts between text and the block
_TAG = re.compile(rf"</?{DSML}[^>\n]*>?")


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
        self.calls = 0
        self.truncated = False  # generation ended inside a block
        self._cut_off = False
        self._state = "block" if inside_block else "text"  # text | block | invoke | value | after
        self._buf = ""
        self._raw = _SEPARATOR + BLOCK_OPEN if inside_block else ""  # everything from the separator before the block on
        self._out: list[ToolCallDelta] = []
        self._first_param = True
        self._quoted = False  # the value being read is a string="true" one

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """More content text → (content that is safe to send, tool-call deltas)."""
        self._buf += text
        if self._state not in ("text", "after"):
            self._raw += text
        return self._run(final=False)

    def finish(self, cut_off: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """End of generation: release held text; an unfinished block is `truncated`. `cut_off` (by the
        token limit): line breaks held back as a block's possible start are dropped too."""
        self._cut_off = cut_off
        content, deltas = self._run(final=True)
        self.truncated = self._state not in ("text", "after")
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
        start = self._buf.find(BLOCK_OPEN)
        if start >= 0:
            before = self._buf[:start]
            text = before.removesuffix(_SEPARATOR)
            self._raw = before[len(text):] + self._buf[start:]
            self._buf = self._buf[start + len(BLOCK_OPEN):]
            self._state = "block"
            return text
        keep = _held(self._buf, _SEPARATOR + BLOCK_OPEN)
        if final:  # the end: a block's start cut off there is dropped; at a natural end line breaks are text
            keep = keep if self._cut_off or keep > len(_SEPARATOR) + 1 else 0
            text, self._buf = self._buf[:len(self._buf) - keep], ""
            return text or None
        if not self._buf or len(self._buf) == keep:
            return None
        text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return text

    def _next_tag(self, close: str, opener: re.Pattern[str]) -> bool | re.Match[str] | None:
        """Inside a block or an invoke, after whitespace: True when `close` follows (consumed), the
        opener's match when it follows (consumed), None otherwise (too early to tell, or malformed)."""
        self._buf = self._buf.lstrip()
        if self._buf.startswith(close):
            self._buf = self._buf[len(close):]
            return True
        match = opener.match(self._buf)
        if match is not None:
            self._buf = self._buf[match.end():]
        return match

    def _block(self, final: bool) -> str | None:
        match = self._next_tag(BLOCK_CLOSE, _INVOKE)
        if match is True:
            self._state = "after"
            return ""
        if match is None:
            return None if _may_start(self._buf, (BLOCK_CLOSE, f'<{DSML}invoke name="')) else self._malformed()
        self._emit(ToolCallDelta(self.calls, id=f"call_{uuid.uuid4().hex[:24]}", name=match.group(1)))
        self._state, self._first_param = "invoke", True
        return ""

    def _invoke(self, final: bool) -> str | None:
        match = self._next_tag(INVOKE_CLOSE, _PARAM)
        if match is True:
            self._emit(ToolCallDelta(self.calls, arguments="{}" if self._first_param else "}"))
            self.calls += 1
            self._state = "block"
            return ""
        if match is None:
            return None if _may_start(self._buf, (INVOKE_CLOSE, f'<{DSML}parameter name="')) else self._malformed()
        self._quoted = match.group(2) == "true"
        lead = "{" if self._first_param else ", "
        self._emit(ToolCallDelta(self.calls, arguments=lead + json.dumps(match.group(1)) + ": " + '"' * self._quoted))
        self._state, self._first_param = "value", False
        return ""

    def _value(self, final: bool) -> str | None:
        end = self._buf.find(PARAM_CLOSE)
        if end >= 0:
            value, self._buf = self._buf[:end], self._buf[end + len(PARAM_CLOSE):]
            self._emit(ToolCallDelta(self.calls, arguments=self._escaped(value) + '"' * self._quoted))
            self._state = "invoke"
            return ""
        keep = _held(self._buf, PARAM_CLOSE)
        if len(self._buf) == keep:
            return None
        value, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        self._emit(ToolCallDelta(self.calls, arguments=self._escaped(value)))
        return None

    def _after(self, final: bool) -> str | None:
        # Past the block only the end of the turn is expected; anything else is kept as content.
        text, self._buf = self._buf, ""
        return text or None

    def _malformed(self) -> str:
        """Not DSML after all: the block's text so far is content (its tags dropped), and parsing stops."""
        text, self._buf, self._state = self._raw, "", "after"
        return _TAG.sub("", text)

    def _escaped(self, value: str) -> str:
        return json.dumps(value, ensure_ascii=False)[1:-1] if self._quoted else value

    def _emit(self, delta: ToolCallDelta) -> None:
        if self.parallel or delta.index == 0:
            self._out.append(delta)


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _may_start(text: str, tags: tuple[str, ...]) -> bool:
    """Whether `text` may still turn into one of `tags` and what follows it: wait for more."""
    return not text or any(tag.startswith(text) or text.startswith(tag) for tag in tags)


# A stray DSML tag (or the lone `｜DSML｜` token, which a weak model can emit anywhere) outside a tool-call
# block; a tag longer than this is not waited for.
_STRAY = re.compile(rf"</?{DSML}[^>\n]*>|{DSML}")
_LONGEST_TAG = 256


class MarkupFilter:
    """Keeps DSML markup out of text that is not parsed for calls (content without tools, reasoning,
    and what the call parser leaves as content): tags and lone `｜DSML｜` tokens are dropped, on any
    tokenizer (one that spells the marker over several tokens included). A possible start of one at the
    end of a piece is held back until the next piece decides it."""

    def __init__(self) -> None:
        self._held = ""

    def push(self, text: str, final: bool = False) -> str:
        if not self._held and not final and "<" not in text and DSML[0] not in text:
            return text  # nothing that is or may become markup (most text: no call below)
        text, self._held = self._held + text, ""
        if not final:  # an unclosed tag at the end waits whole; then part of a lone marker does
            keep = _open_tag(text)
            text, self._held = text[:len(text) - keep], text[len(text) - keep:]
        if DSML[0] in text:
            text = _STRAY.sub("", text)
        if not final and not self._held:
            keep = _held(text, DSML)
            text, self._held = text[:len(text) - keep], text[len(text) - keep:]
        return text


def _open_tag(text: str) -> int:
    """Length of the end of `text` that may still become a DSML tag (it has not closed yet)."""
    start = text.rfind("<", max(0, len(text) - _LONGEST_TAG))
    if start < 0:
        return 0
    tail = text[start:]
    if tail.startswith(("<" + DSML, "</" + DSML)) and ">" not in tail and "\n" not in tail:
        return len(tail)
    return len(tail) if ("<" + DSML).startswith(tail) or ("</" + DSML).startswith(tail) else 0
