"""Streaming detokenization: generated token ids in, text that is safe to send out.

One :class:`IncrementalDetokenizer` lives per generated sequence. Each :meth:`~IncrementalDetokenizer.push`
returns only text that can never change later:

- bytes of a UTF-8 character split across tokens are held until the character is complete, so a
  client never receives half a character (or a U+FFFD that later "should have been" a character);
- a tail of the text that could still grow into a stop string is held until it either completes
  the stop string (and is dropped) or stops being a candidate (and is emitted).

So the chunks a streaming client receives, joined, are exactly the non-streaming result, however
the text happened to be split into tokens.

Where the tokenizer's per-token bytes are exact (byte-level vocabularies, DeepSeek's own), tokens
become text through their bytes alone. Any other decoder can make a token's text depend on its
neighbours (a leading space dropped at the start, ``##`` joins, byte tokens that only form a
character together, fused or stripped text), so there the text comes from decoding a short window
of ids twice, with and without the newest tokens, and emitting what they added.
"""

from __future__ import annotations

from codecs import utf_8_decode
from collections.abc import Sequence
from typing import Protocol

from v4serve.server.text.tokenizer import Tokenizer

FFFD = "\ufffd"
# A character split into byte tokens (ByteFallback) is complete within 4 tokens. A window that still
# ends in U+FFFD long after that holds garbage bytes or a literal U+FFFD, and is let go so decoding
# cost stays bounded.
_MAX_HELD_TOKENS = 16

# (text, final) -> the part of the text a client is sent; it may hold text back until final.


class _TokenText(Protocol):
    """Token ids in, text out: text that later tokens cannot change, and at the end all the rest."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class _ByteText:
    """Exact per-token bytes: join them, cutting before an incomplete UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._partial = b""  # the start of a character the next token's bytes may complete

    def push(self, token_id: int) -> str:
        # What an incremental UTF-8 decoder does, without its Python layer (this runs for every token):
        # errors="replace" with final=False holds an incomplete trailing sequence (it may still be
        # completed) but turns bytes that can never be valid into U+FFFD straight away.
        data = self._tokenizer.token_bytes(token_id, skip_special_tokens=self._skip)
        if self._partial:
            data = self._partial + data
        text, used = utf_8_decode(data, "replace", False)
        self._partial = data[used:]
        return text

    def flush(self) -> str:
        text, _ = utf_8_decode(self._partial, "replace", True)
        self._partial = b""
        return text


class _WindowText:
    """Any decoder: ids[prefix:read] is text already emitted, kept as context for the ids after it.

    Decoding the window with and without the ids since ``read`` and emitting the difference gives
    each token its text as it reads in the middle of the sequence, because the window's first
    token is treated the same way in both decodes (for instance losing a leading space) and that
    cancels out. New text ending in U+FFFD is held: ByteFallback decodes an incomplete character
    to U+FFFD, and the next byte token may complete it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        if self._dropped(token_id):
            return ""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        emitted = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        let_go = final or len(self._ids) - self._read >= _MAX_HELD_TOKENS
        if not let_go and (len(text) <= len(emitted) or text.endswith(FFFD)):
            return ""
        # A decoder that rewrote the emitted part given the new context cannot be honoured (that
        # text is gone); slicing by length keeps the stream going and is exact for the
        # token-local decoders `tokenizers` ships.
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(emitted):]

    def _dropped(self, token_id: int) -> bool:
        # `decode` drops these ids wherever they stand; left out of the window, they cannot keep
        # it growing or count towards the U+FFFD hold limit.
        if self._skip and token_id in self._tokenizer.special_token_ids:
            return True
        return not 0 <= token_id < self._tokenizer.vocab_size

    def _decode(self, start: int, end: int) -> str:
        if start == end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into emit-ready text, honouring stop strings.

    When several stop strings occur, the one whose last character arrives first wins (ties go to
    the one starting earlier). That is the only rule that does not depend on how the text was split
    into tokens: a stream stops the moment any stop string is complete.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        text_of = _ByteText if tokenizer.exact_token_bytes else _WindowText
        self._tokens: _TokenText = text_of(tokenizer, skip_special_tokens)
        # Stop strings only count in text that comes after the first `min_tokens` tokens.
        self._unstoppable = min_tokens
        self._include_stop = include_stop_str_in_output
        self._stops = _normalise_stops(stop)
        # Proper prefixes only: a complete stop string is a match, never something to wait on.
        self._stop_prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self._chunks: list[str] = []
        self._stop_reason: str | None = None
        self.stopped = False  # a stop string has matched; later tokens are then ignored
        self._flushed = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            # Joined lazily and kept joined, so repeated reads do not re-join every chunk.
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, or None."""
        return self._stop_reason

    def push(self, token_id: int) -> str:
        """Feed one generated token; return the text that became safe to emit (possibly "")."""
        if self._flushed:
            raise RuntimeError("push() after flush(): the sequence has already finished")
        if self.stopped:
            return ""
        new = self._tokens.push(token_id)
        if not self._stops:  # the common case, and one call per token fewer: nothing to match or hold
            if new:
                self._chunks.append(new)
            return new
        if self._unstoppable > 0:
            self._unstoppable -= 1
            return self._emit(new)
        return self._advance(new, final=False)

    def flush(self) -> str:
        """End of generation: release everything held back; incomplete UTF-8 becomes U+FFFD."""
        if self._flushed:
            return ""
        self._flushed = True
        if self.stopped:
            return ""
        return self._advance(self._tokens.flush(), final=True)

    def _advance(self, new: str, final: bool) -> str:
        if not new and not final:
            return ""
        # Any stop string not yet seen must start inside the held tail (a longer-ago start would
        # have kept its beginning held), so the tail plus the new text is the whole search space.
        window = self._pending + new
        match = self._find_stop(window)
        if match is not None:
            return self._finish_at(window, *match)
        hold = 0 if final else self._held_suffix_len(window)
        cut = len(window) - hold
        self._pending = window[cut:]
        return self._emit(window[:cut])

    def _find_stop(self, window: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = window.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate < best:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _finish_at(self, window: str, start: int, stop: str) -> str:
        self._stop_reason, self.stopped = stop, True
        self._pending = ""
        end = start + len(stop) if self._include_stop else start
        return self._emit(window[:end])

    def _held_suffix_len(self, window: str) -> int:
        # Longest first: holding a shorter candidate would leak the start of a longer one.
        for k in range(min(len(window), self._max_hold), 0, -1):
            if window[-k:] in self._stop_prefixes:
                return k
        return 0

    def _emit(self, chunk: str) -> str:
        if chunk:
            self._chunks.append(chunk)
        return chunk


def _normalise_stops(stop: Sequence[str] | str) -> tuple[str, ...]:
    # A bare string is one stop string, not a list of one-character ones; an empty stop string
    # would end every sequence before its first token, so it is treated as absent.
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    return tuple(dict.fromkeys(s for s in items if s))
