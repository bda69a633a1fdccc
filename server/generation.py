"""What both endpoints share: OpenAI fields → engine requests, and running them as text.

A `Generation` is one prompt's choices (n ≥ 1) in the engine: token outputs in, text deltas out
(`text.output.ChoiceText`), with the front end's latency metrics. The engine sees token ids only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from v4serve.engine.async_engine import AsyncEngine
from v4serve.engine.request import Request as EngineRequest
from v4serve.engine.request import SamplingParams
from v4serve.server.errors import ApiError
from v4serve.server.framing import PromptUsage
from v4serve.server.metrics import Metrics
from v4serve.server.protocol import SamplingFields
from v4serve.server.text.output import ChoiceText, Delta, OutputOptions
from v4serve.server.text.tokenizer import THINK_END, Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    max_model_len: int
    api_key: str | None = None


class Generation:
    def __init__(self, engine: AsyncEngine, metrics: Metrics, tokenizer: Tokenizer, requests: list[EngineRequest],
                 options: OutputOptions) -> None:
        self.engine, self.metrics, self.requests = engine, metrics, requests
        self.texts = [ChoiceText(tokenizer, options) for _ in requests]

    async def deltas(self) -> AsyncIterator[Delta]:
        """Every choice's deltas until all have finished. A stop string ends its choice here and
        stops the engine request; closing this early (a client disconnect) aborts the rest."""
        tracker = self.metrics.track(self.requests)
        open_choices = set(range(len(self.requests)))
        try:
            async with contextlib.aclosing(self.engine.generate(self.requests)) as outputs:
                async for out in outputs:
                    if out.index not in open_choices:
                        continue  # after a stop string: what the engine made meanwhile, and its abort
                    delta = self.texts[out.index].push(out)
                    tracker.tokens(out.index, len(delta.token_ids))
                    if delta.finished:
                        open_choices.discard(out.index)
                        if delta.error is None:
                            tracker.finish(out.index, delta.finish_reason or "stop")
                        if not out.finished:
                            self.engine.abort([self.requests[out.index].request_id])
                    yield delta
                    if not open_choices:
                        return
        finally:
            for i in open_choices:
                tracker.finish(i, "abort")

    def usage(self) -> PromptUsage:
        return PromptUsage(prompt_tokens=self.requests[0].num_prompt_tokens,
                           cached_tokens=self.texts[0].num_cached_tokens,
                           completion_tokens=sum(t.num_tokens for t in self.texts))


class FrontEnd:
    """Request handling shared by the endpoints, kept apart from routing."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, config: ServerConfig, metrics: Metrics) -> None:
        self.engine, self.tokenizer, self.config, self.metrics = engine, tokenizer, config, metrics
        think_end = tokenizer.encode(THINK_END)
        self.think_end_id = think_end[0] if len(think_end) == 1 else None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise ApiError(404, f"The model `{name}` does not exist.", "NotFoundError", "model", "model_not_found")

    @staticmethod
    def warn_extras(body: SamplingFields) -> None:
        extra = sorted((body.model_extra or {}).keys())
        if extra:
            log.warning("ignoring unsupported request fields: %s", ", ".join(extra))

    def default_max_tokens(self, requested: int | None, prompt_len: int) -> int:
        if requested is not None:
            return requested
        return max(1, self.config.max_model_len - prompt_len)

    @staticmethod
    def sampling(body: SamplingFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                 seed_offset: int = 0) -> SamplingParams:
        bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=-1 if body.top_k in (None, 0) else body.top_k,
            min_p=body.min_p or 0.0, seed=None if body.seed is None else body.seed + seed_offset,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, logit_bias=bias,
            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    @staticmethod
    def output_options(body: SamplingFields, reasoning_end_token: int | None = None) -> OutputOptions:
        return OutputOptions(stop=tuple(body.stop_list()), include_stop_str_in_output=body.include_stop_str_in_output,
                             skip_special_tokens=body.skip_special_tokens, reasoning_end_token=reasoning_end_token)

    def generation(self, request_id: str, prompt: list[int], body: SamplingFields, max_tokens: int,
                   logprobs: int | None, options: OutputOptions, prompt_logprobs: int | None = None) -> Generation:
        """The n choices of one prompt (not yet submitted)."""
        requests = [EngineRequest(f"{request_id}-{i}", list(prompt),
                                  self.sampling(body, max_tokens, logprobs, prompt_logprobs, seed_offset=i),
                                  cache_salt=body.cache_salt) for i in range(body.n)]
        return Generation(self.engine, self.metrics, self.tokenizer, requests, options)

    def encode_text_prompt(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        bos = self.tokenizer.bos_token_id
        return ids if ids[:1] == [bos] else [bos] + ids

    def token_text(self, token: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def check(self, generations: list[Generation]) -> None:
        """Raise now if the engine cannot take these (so errors come before a stream's first byte)."""
        self.engine.check([r for g in generations for r in g.requests])

    @staticmethod
    async def collect(generation: Generation, raw: Request) -> list[list[Delta]]:
        """All deltas of every choice (non-streaming); aborts if the client disconnects meanwhile."""
        per_choice: list[list[Delta]] = [[] for _ in generation.requests]

        async def consume() -> None:
            async with contextlib.aclosing(generation.deltas()) as deltas:
                async for delta in deltas:
                    if delta.error:
                        raise ApiError(500, delta.error, "server_error", code="generation_failed")
                    per_choice[delta.index].append(delta)

        task = asyncio.ensure_future(consume())
        while not task.done():
            await asyncio.wait([task], timeout=0.25)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ApiError(499, "client disconnected")
        task.result()
        return per_choice
