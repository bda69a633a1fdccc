"""One choice's generated token ids → text the client can be sent, on the front end's side.

Incremental detokenizing (never half a character), the reasoning/content split at the `</think>`
token in thinking mode, and stop strings: when one completes, the choice is finished here and the
front end stops the engine request (tokens it produced meanwhile are dropped, never counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from v4serve.engine.process.client import TokenOutput
from v4serve.engine.request import Sample
from v4serve.server.text.detokenizer import IncrementalDetokenizer
from v4serve.server.text.tokenizer import THINK_END, Tokenizer
from v4serve.server.text.tool_calls import ReasoningSplit, ToolCallDelta, ToolCallParser


@dataclass(frozen=True)
class OutputOptions:
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Thinking mode: tokens before `</think>` are reasoning, the rest content.
    reasoning_end_token: int | None = None
    min_tokens: int = 0  # no stop string matches within the first this many tokens
    tool_calls: bool = False  # parse DSML tool calls out of the content
    parallel_tool_calls: bool = True
    inside_tool_calls: bool = False  # the prompt opened the tool-call block (a forced call, chat mode)


@dataclass
class Delta:
    """What one choice produced since its last delta."""

    index: int
    text: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    error_param: str | None = None  # set when the request caused the error: a 400 naming this field


def joins(last: Delta, then: Delta, text_before: bool) -> bool:
    """Whether one SSE chunk can carry `then` after a run of deltas ending in `last` (`text_before`: the
    run has content): not for another choice, after an end or an error or with one, with tool-call
    fragments (each call's fragments go out as they came), or reasoning after content (one chunk would
    put it first)."""
    return not (then.index != last.index or last.finished or last.error is not None or then.error is not None
                or last.tool_calls or then.tool_calls or (text_before and then.reasoning))


def joined(run: list[Delta]) -> Delta:
    """A run of deltas of one choice (each `joins` the one before) as one: the texts and tokens in order,
    the end of the last."""
    last = run[-1]
    return Delta(run[0].index, "".join(d.text for d in run), "".join(d.reasoning for d in run),
                 [t for d in run for t in d.token_ids], [s for d in run for s in d.samples],
                 finished=last.finished, finish_reason=last.finish_reason)


class ChoiceText:
    def __init__(self, tokenizer: Tokenizer, options: OutputOptions) -> None:
        def detok(stop: tuple[str, ...]) -> IncrementalDetokenizer:
            return IncrementalDetokenizer(tokenizer, skip_special_tokens=options.skip_special_tokens, stop=stop,
                                          include_stop_str_in_output=options.include_stop_str_in_output,
                                          min_tokens=options.min_tokens)

        self.options = options
        self.tools = ToolCallParser(options.parallel_tool_calls, options.inside_tool_calls) if options.tool_calls \
            else None
        # Without tools DSML is text, as DeepSeek's parser reads it; with them a call may begin in the
        # reasoning, which then ends there.
        self.content = detok(options.stop)
        self.reasoning = detok(()) if options.reasoning_end_token is not None else None
        self.think_end = tokenizer.token_to_id(THINK_END)
        self.split = ReasoningSplit() if self.tools is not None and self.reasoning is not None else None
        self.num_tokens = 0  # tokens of this choice's completion (up to a stop string, if one matched)
        self.num_reasoning_tokens = 0  # of those, the thinking (its closing `</think>` included)
        self.num_cached_tokens = 0
        self.prompt_logprobs: tuple | None = None
        self.finished = False

    def push(self, out: TokenOutput) -> Delta:
        delta = Delta(index=out.index, error=out.error, error_param=out.error_param)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        content = self.content
        plain = self.reasoning is None and self.tools is None  # text straight from the detokenizer
        for token, sample in zip(out.token_ids, out.samples, strict=True):
            if content.stopped:
                break
            self.num_tokens += 1
            delta.token_ids.append(token)
            delta.samples.append(sample)
            if token == self.think_end and self.reasoning is None:
                continue  # a `</think>` in the answer is no text, as DeepSeek's parser reads it
            if plain:
                delta.text += content.push(token)
            else:
                self._route(token, delta)
        if out.finished or self.content.stopped:
            self._flush(delta, cut_off=out.finish_reason == "length" and not self.content.stopped)
            self.finished = delta.finished = True
            delta.finish_reason = "stop" if self.content.stopped else out.finish_reason
            if delta.finish_reason == "stop" and self.tools is not None and self.tools.begun:
                delta.finish_reason = "tool_calls"
        return delta

    def _route(self, token: int, delta: Delta) -> None:
        self.num_reasoning_tokens += self.reasoning is not None
        if self.reasoning is not None and token == self.options.reasoning_end_token:
            self._reasoning(delta, self.reasoning.flush(), final=True)
            self.reasoning = None  # from here on, content
        elif self.reasoning is not None:
            self._reasoning(delta, self.reasoning.push(token))
        else:
            self._content(delta, self.content.push(token))

    def _reasoning(self, delta: Delta, text: str, final: bool = False) -> None:
        if self.split is None:
            delta.reasoning += text
            return
        reasoning, rest = self.split.push(text, final)
        delta.reasoning += reasoning
        if self.split.ended:  # a call began in the reasoning: the rest is the call parser's
            self.split = None
            if self.reasoning is not None:
                rest += self.reasoning.flush()
                self.reasoning = None
            self._content(delta, rest)

    def _content(self, delta: Delta, text: str, final: bool = False, cut_off: bool = False) -> None:
        if self.tools is None:
            delta.text += text
            return
        content, calls = self.tools.push(text)
        if final:
            more, last = self.tools.finish(cut_off)
            content, calls = content + more, calls + last
        delta.text += content
        delta.tool_calls += calls

    def _flush(self, delta: Delta, cut_off: bool) -> None:
        if self.reasoning is not None:
            self._reasoning(delta, self.reasoning.flush(), final=True)
        text = "" if self.content.stopped else self.content.flush()
        if cut_off and self.tools is not None:  # a character the limit cut in two is nothing in a call
            text = text.rstrip("\ufffd")
        self._content(delta, text, final=True, cut_off=cut_off)
