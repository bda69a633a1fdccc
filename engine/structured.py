"""Constrained decoding: a request's grammar as a token mask in the sampler.

The front end turns `response_format` and forced tool calls into a `GrammarSpec` (a JSON schema or a
Lark grammar, text either way: it crosses the engine boundary like token ids). `Grammars` compiles
specs with llguidance against the model's vocabulary (its tokenizer.json, as data: the engine never
tokenizes), keeps each compiled grammar once, and gives every request its own matcher. A request
without a grammar pays nothing.

llguidance over xgrammar, measured side by side on this vocabulary: it has no dependencies
(xgrammar imports transformers and pulls triton), compiles a schema in about 1 ms, reports
unsupported schema keywords instead of ignoring them (xgrammar silently drops `not` and
`uniqueItems`), and treats control tokens right out of the box; its masks (≈20 µs a token, 0.4 ms to
apply on a 129K vocabulary) are small next to a forward pass.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import llguidance.numpy as llg_np
import numpy as np

from v4serve.engine.request import GrammarSpec, RequestError

# Compiled grammars kept per process, weighed by their text: a compiled grammar takes roughly 30× its
# text in memory (a 0.5 MB enum schema, ~14 MB), so 8 MiB of text is a few hundred MB at most.
GRAMMAR_CACHE_TEXT_BYTES = 8 << 20


class Grammars:
    """Compiled grammars for one vocabulary, the least recently used dropped past `max_text_bytes` of
    grammar text; safe to use from the engine and the asyncio side."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int,
                 max_text_bytes: int = GRAMMAR_CACHE_TEXT_BYTES) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._compiling: dict[tuple[str, str], threading.Lock] = {}  # grammars being compiled now
        self.max_text_bytes = max_text_bytes
        self.text_bytes = 0  # of the grammars kept
        self.compiles = 0  # cache misses, for tests and the benchmark

    def check(self, spec: GrammarSpec) -> None:
        """Compile now (or find it compiled) and compute the first mask: an invalid or unsupported
        grammar, or one that allows no first token (a schema whose only definition is itself), is a
        400 before any response byte is sent."""
        self.matcher(spec).allowed_bitmask()

    def compiled(self, spec: GrammarSpec) -> bool:
        """Whether this grammar is compiled already (so a matcher for it costs a copy)."""
        with self._lock:
            return (spec.kind, spec.text) in self._compiled

    def matcher(self, spec: GrammarSpec) -> RequestGrammar:
        return RequestGrammar(self._template(spec).deep_copy(), spec.after_token, self.vocab_size, spec.param)

    def _template(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        key = (spec.kind, spec.text)
        template = self._kept(key)
        if template is not None:
            return template
        with self._lock:
            compiling = self._compiling.setdefault(key, threading.Lock())
        with compiling:  # one compile per grammar: requests that bring it meanwhile wait for that one
            try:
                template = self._kept(key)
                return template if template is not None else self._compile(spec, key)
            finally:
                with self._lock:
                    self._compiling.pop(key, None)

    def _kept(self, key: tuple[str, str]) -> llguidance.LLMatcher | None:
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
            return template

    def _compile(self, spec: GrammarSpec, key: tuple[str, str]) -> llguidance.LLMatcher:
        if spec.kind == "json_schema":
            # Compact JSON: no free whitespace, so a weak model cannot pad until max_tokens.
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides={"whitespace_flexible": False})
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(spec.text)
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise RequestError(f"{spec.param}: the grammar engine cannot use this: {template.get_error()}",
                               param=spec.param)
        with self._lock:
            self.compiles += 1
            if key not in self._compiled:
                self._compiled[key] = template
                self.text_bytes += len(spec.text)
            while self.text_bytes > self.max_text_bytes and len(self._compiled) > 1:
                (_, text), _ = self._compiled.popitem(last=False)
                self.text_bytes -= len(text)
        return template


def require(grammars: Grammars | None, spec: GrammarSpec) -> Grammars:
    """The grammars of an engine that can enforce `spec`, or the 400 saying why it cannot."""
    if grammars is None:
        raise RequestError("structured outputs need the model's tokenizer, which this engine was not given",
                           param=spec.param)
    return grammars


class RequestGrammar:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, after_token: int | None, vocab_size: int,
                 param: str = "response_format") -> None:
        self._matcher = matcher
        self._after_token = after_token
        self._bitmask = llg_np.allocate_token_bitmask(1, vocab_size)
        self._param = param
        self._accepted = 0

    @property
    def active(self) -> bool:
        return self._after_token is None

    @property
    def done(self) -> bool:
        """The grammar has ended (its EOS was accepted): the request is complete."""
        return self.active and self._matcher.is_stopped()

    def allowed_bitmask(self) -> np.ndarray:
        """The tokens the grammar allows next: bit t % 32 of int32 word t // 32 (a fresh copy: the
        sampler stacks the step's masks and applies them on the device)."""
        llg_np.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        if self._matcher.is_error():
            raise self._gave_up()
        return self._bitmask[0].copy()

    def draftable(self, drafts: list[int]) -> list[int]:
        """The drafts the grammar allows from here, cut before any it forbids and before any after
        which it would be done (an accepted draft must never end the request). Nothing is consumed."""
        if not self.active:
            return []
        kept = []
        for token in drafts[:self._matcher.validate_tokens(drafts)]:  # each of these can be consumed
            self._matcher.consume_token(token)
            if self._matcher.is_stopped():
                self._matcher.rollback(1)
                break
            kept.append(token)
        self._matcher.rollback(len(kept))
        return kept

    def allowed_after(self, drafted: list[int]) -> np.ndarray:
        """The tokens allowed after these (allowed) drafts, the grammar left where it was."""
        if not drafted:
            return self.allowed_bitmask()
        self._matcher.consume_tokens(drafted)
        try:
            return self.allowed_bitmask()
        finally:
            self._matcher.rollback(len(drafted))

    def _gave_up(self) -> RequestError:
        """The grammar engine cannot go on (a schema that admits no finite value, one too ambiguous
        to parse within its limits): the request's doing, so a 400 naming the field."""
        reason = self._matcher.get_error().split("\n", 1)[0].strip()
        return RequestError(f"{self._param}: the grammar engine cannot continue after {self._accepted} tokens: "
                            f"{reason}", param=self._param)

    def accept(self, token: int) -> None:
        if not self.active:
            if token == self._after_token:
                self._after_token = None
            return
        if not self._matcher.consume_token(token):
            raise self._gave_up()
        self._accepted += 1
