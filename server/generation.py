"""What both endpoints share: OpenAI fields → engine requests, and running them as text.

A `Generation` is one prompt's choices (n ≥ 1) in the engine: token outputs in, text deltas out
(`text.output.ChoiceText`), with the front end's latency metrics. The engine sees token ids only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from fastapi import Request

from v4serve.engine.process.client import EngineClient, TokenOutput
from v4serve.engine.request import MAX_TOP_K, GrammarSpec, SamplingParams
from v4serve.engine.request import Request as EngineRequest
from v4serve.server import jobs
from v4serve.server.config import (
    DEFAULT_MAX_LOGPROB_ENTRIES,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_UNREAD_TOKENS,
    DEFAULT_UNREAD_TIMEOUT,
)
from v4serve.server.errors import ApiError, echo, internal_error
from v4serve.server.framing import PromptUsage
from v4serve.server.handover import Handovers, request_transfer, sglang_transfer
from v4serve.server.metrics import Metrics
from v4serve.server.preprocess import PreprocessConfig, Preprocessor
from v4serve.server.protocol import SamplingFields
from v4serve.server.tenants import CURRENT_TENANT, DEFAULT_TENANT, ApiKeys, scoped_salt
from v4serve.server.text.chat_encoding import prompt_format_of
from v4serve.server.text.output import ChoiceText, Delta, OutputOptions, joined, joins
from v4serve.server.text.tokenizer import IMAGE, THINK_END, Tokenizer

log = logging.getLogger(__name__)

# Threads that compile grammars in the front end (each compile holds one; the rest queue).
GRAMMAR_COMPILERS = 2
# Seconds between looks at whether a waiting request's client has gone.
DISCONNECT_POLL = 0.25


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    max_model_len: int
    aliases: tuple[str, ...] = ()  # more names of the same model (--served-model-name a b c)
    keys: ApiKeys | None = None  # --api-key and --api-keys-file (None: no key asked)
    isolate_tenants: bool = False  # each tenant's prefix cache its own (a keys file, no --shared-prefix-cache)
    swa_cache_mode: str = "periodic"  # the daemon's (a request's own `swa_cache_mode` overrides it)
    default_thinking: bool = True  # a chat request naming no thinking mode thinks (the converter's default)
    protect_metrics: bool = False  # /metrics needs the API key too
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_unread_tokens: int = DEFAULT_MAX_UNREAD_TOKENS
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES
    unread_timeout: float = DEFAULT_UNREAD_TIMEOUT
    max_request_tokens: int | None = None  # prompts + n × max_tokens of one request (None: no ceiling)
    responses_store_bytes: int = 256 << 20  # stored Responses API responses, all counted
    # Several API-server processes: the folder their stored responses share (None: kept in memory).
    responses_folder: str | None = None
    api_server: tuple[int, int] = (0, 1)  # this process's index among the API servers, and their count
    max_requests: int = 2048  # requests running at once (--max-connections); the probes are always answered
    allowed_origins: tuple[str, ...] = ()  # web origins whose pages may call the API (CORS); "*" for any
    stall_timeout: float = 60.0  # /health: 503 once the engine has been silent this long
    unknown_fields: str = "accept"  # a field no request model defines: accept (dropped, named) or refuse
    stream_keepalive: float = 10.0  # seconds a stream goes without an event before a keep-alive is sent
    # What /version reports beside the package version: device, dtype, kernels, KV cache dtype.
    version_info: dict[str, str | bool | int] = field(default_factory=dict)
    handovers: Handovers | None = None  # this replica's role with prefill and decode apart (None: neither)
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models: when the daemon started

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.aliases)


T = TypeVar("T")

# What `Generation.deltas` yields when woken (`Generation.wake`) in place of output: no choice's delta.
WAKE = Delta(index=-1)
# Deltas one SSE chunk carries at most: a front end far behind sends a stream's backlog in bounded chunks,
# each a bounded piece of work for the event loop.
JOINED_AT_MOST = 256


class Pipe(Generic[T]):
    """A first-in first-out handoff to one reader on the event loop: `put` from any callback, `await
    get()` from the reader. What asyncio.Queue does for a stream's every token in ~15 Python calls,
    in 3: no size bound, one reader (a cancelled `get` loses nothing: its items stay)."""

    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: deque[T] = deque()  # what `get` returns next, first on the left
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: T) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get(self) -> T:
        while not self.items:
            await self.arrival()
        return self.items.popleft()

    def arrival(self) -> asyncio.Future[None]:
        """A future done when the next item is put (a reader that pops `items` itself awaits this when
        they are empty: a call per item fewer than `get`)."""
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def empty(self) -> bool:
        return not self.items


def _logprob_entries(delta: Delta) -> int:
    """Its tokens' logprob entries: each sampled token and its alternatives (a loop, not a generator:
    this runs for every streamed token)."""
    entries = len(delta.samples)
    for sample in delta.samples:
        if sample.top:
            entries += len(sample.top)
    return entries


class Generation:
    """Text is made as token outputs arrive (on the event loop), not when the client reads it: a
    stop string stops the engine request at once and latency is measured at arrival, however slowly
    the client consumes the stream. What the client has not read yet is bounded: past half of
    `max_unread` (tokens, each logprob entry counting as one more) the engine holds the choices (they
    keep their cache) until the client has read down to a quarter; held for `unread_timeout` seconds,
    or past `max_unread` (what was already on its way), they end with an error."""

    def __init__(self, engine: EngineClient, metrics: Metrics, tokenizer: Tokenizer, requests: list[EngineRequest],
                 options: OutputOptions, max_unread: int = DEFAULT_MAX_UNREAD_TOKENS,
                 max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES,
                 unread_timeout: float = DEFAULT_UNREAD_TIMEOUT, tenant: str = DEFAULT_TENANT) -> None:
        self.engine, self.requests = engine, requests
        self.texts = [ChoiceText(tokenizer, options) for _ in requests]
        self._tracker = metrics.track(requests, tenant)
        self._metrics = metrics
        self._open = set(range(len(requests)))  # choices whose finished delta has not been made
        # Each delta with its weight: what it holds, in tokens plus their logprob entries (the bulk of its bytes).
        self._ready: Pipe[tuple[Delta, int]] = Pipe()
        self._unread, self._max_unread = 0, max_unread
        self._logprob_entries, self._max_logprob_entries = 0, max_logprob_entries
        self._unread_timeout = unread_timeout
        self._held: asyncio.TimerHandle | None = None  # while the engine holds the choices: the deadline
        # Prefill and decode apart (server/handover.py): asked to hand its KV over; the transfer id it is
        # handed over under (None: it is not); what the reply says of it, once the request is done.
        self.handover_asked = False
        self.handover: str | None = None
        self.kv_transfer_params: dict[str, Any] | None = None

    def transfer_reply(self) -> dict[str, Any]:
        """The reply's `kv_transfer_params` (vLLM's field, which its router hands the decode leg), if asked."""
        return {"kv_transfer_params": self.kv_transfer_params} if self.handover_asked else {}

    @property
    def prompt_logprobs(self) -> tuple:
        """The prompt's logprobs, shared by every choice (the first choice's request computes them and
        its first output, which comes before any other choice's, carries them)."""
        return self.texts[0].prompt_logprobs or ()

    async def deltas(self) -> AsyncIterator[Delta]:
        """Submit the choices and yield their deltas until each has finished (one finished delta
        per choice). Closing this early (a client disconnect) aborts the choices still running."""
        self.engine.submit(self.requests, self._on_output)
        remaining = len(self.requests)
        try:
            ready, items = self._ready, self._ready.items
            while remaining:
                if not items:
                    await ready.arrival()
                    continue
                delta, weight = items.popleft()
                if delta is WAKE:
                    yield delta
                    continue
                if items:  # more queued while this stream waited: a front end behind the engine
                    delta, weight = self._join_queued(delta, weight)
                self._unread -= weight
                if self._held is not None and self._unread <= self._max_unread // 4:
                    self._hold(False)
                remaining -= delta.finished
                yield delta
        finally:
            if self._held is not None:
                self._held.cancel()
                self._held = None
            if self._open:
                self.engine.abort([self.requests[i].request_id for i in sorted(self._open)])
                for i in self._open:
                    self._tracker.finish(i, "abort")
                self._open.clear()

    def _join_queued(self, delta: Delta, weight: int) -> tuple[Delta, int]:
        """`delta` and the queued deltas that can follow it in one SSE chunk (at most JOINED_AT_MOST), as
        one: the busier the front end, the less work it does per token."""
        items, run, text = self._ready.items, [delta], bool(delta.text)
        while items and len(run) < JOINED_AT_MOST and joins(run[-1], items[0][0], text):
            then, more = items.popleft()
            run.append(then)
            weight, text = weight + more, text or bool(then.text)
        return (joined(run) if len(run) > 1 else delta), weight

    def wake(self) -> None:
        """Have `deltas` yield WAKE now, unless output is waiting to be read (a stream's keep-alive
        timer: `framing.Pacing`)."""
        if self._ready.empty():
            self._ready.put((WAKE, 0))

    def _on_output(self, out: TokenOutput) -> None:
        if out.index not in self._open:
            return  # after a stop string: what the engine made meanwhile, and its abort
        try:
            delta = self.texts[out.index].push(out)
        except Exception as exc:  # this choice's text failed: it alone ends
            failed = internal_error(exc, f"turning {self.requests[out.index].request_id}'s tokens into text failed")
            delta = Delta(index=out.index, finished=True, finish_reason="error",
                          error=f"detokenizing failed: {failed.message}")
        self._tracker.tokens(out.index, len(delta.token_ids))
        if delta.finished:
            self._open.discard(out.index)
            if delta.error is None:
                self._tracker.finish(out.index, delta.finish_reason or "stop")
            if not out.finished:  # a stop string (or a text failure) ended it before the engine did
                self.engine.abort([self.requests[out.index].request_id])
        entries = _logprob_entries(delta)
        weight = max(len(delta.token_ids), entries)
        self._ready.put((delta, weight))
        self._unread += weight
        self._logprob_entries += entries
        if self._held is None and self._unread > self._max_unread // 2 and self._open:
            self._hold(True)
        if self._unread > self._max_unread and self._open:
            self._metrics.count_limited("unread_output")
            self._end(f"the client left {self._unread} tokens of output unread (--max-unread-tokens "
                      f"{self._max_unread}); the request was ended")
        elif self._logprob_entries > self._max_logprob_entries and self._open:
            self._metrics.count_limited("logprob_entries")
            self._end(f"the request's logprobs passed {self._max_logprob_entries} entries (--max-logprob-entries; "
                      "ask for fewer tokens, choices or top logprobs); the request was ended", param="logprobs")

    def _hold(self, held: bool) -> None:
        """Have the engine stop (or resume) scheduling the open choices; a hold has a deadline."""
        self.engine.pause([self.requests[i].request_id for i in sorted(self._open)], held)
        if held:
            self._metrics.count_limited("unread_held")
            self._held = asyncio.get_running_loop().call_later(self._unread_timeout, self._held_too_long)
        elif self._held is not None:
            self._held.cancel()
            self._held = None

    def _held_too_long(self) -> None:
        self._held = None
        if self._open:
            self._metrics.count_limited("unread_output")
            self._end(f"the client read none of its stream's last {self._unread} tokens for {self._unread_timeout:g} "
                      "s (--unread-timeout); the request was ended")

    def _end(self, message: str, param: str | None = None) -> None:
        """End what still runs with `message`, rather than hold or return its output without bound (a
        client not reading, or far slower than the engine writes; logprobs past their bound); the
        error follows what was made, for whoever reads."""
        log.warning("%s: %s", self.requests[0].request_id.rsplit("-", 1)[0], message)
        if self._held is not None:
            self._held.cancel()
            self._held = None
        self.engine.abort([self.requests[i].request_id for i in sorted(self._open)])
        for i in sorted(self._open):
            self._tracker.finish(i, "abort")
            self._ready.put((Delta(index=i, finished=True, finish_reason="error", error=message,
                                          error_param=param), 0))
        self._open.clear()

    def usage(self) -> PromptUsage:
        return PromptUsage(prompt_tokens=self.requests[0].num_prompt_tokens,
                           cached_tokens=self.texts[0].num_cached_tokens,
                           completion_tokens=sum(t.num_tokens for t in self.texts),
                           reasoning_tokens=sum(t.num_reasoning_tokens for t in self.texts))


class FrontEnd:
    """Request handling shared by the endpoints, kept apart from routing."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, config: ServerConfig, metrics: Metrics,
                 prep: Preprocessor | None = None) -> None:
        self.engine, self.tokenizer, self.config, self.metrics = engine, tokenizer, config, metrics
        self.prep = prep or Preprocessor(tokenizer, PreprocessConfig(workers=0))
        self.prep.on_cpu_limit = lambda: metrics.count_limited("preprocess_cpu")
        self._compilers = ThreadPoolExecutor(GRAMMAR_COMPILERS, thread_name_prefix="v4serve-grammar")
        think_end = tokenizer.encode(THINK_END)
        self.think_end_id = think_end[0] if len(think_end) == 1 else None
        # Where the prompt format writes an image as its placeholder (V4.1), the one id the model must not read
        # without an image behind it (the vision tower is not served yet).
        self.image_id = tokenizer.token_to_id(IMAGE) if prompt_format_of(tokenizer).image_text is None else None

    def check_model(self, name: str | None) -> str:
        """The served name a request asked for (replies carry it), or the first one when it named none."""
        if name is None:
            return self.config.served_model_name
        if name not in self.config.model_names:
            raise ApiError(404, f"The model {echo(name)} does not exist.", "NotFoundError", "model", "model_not_found")
        return name

    @staticmethod
    def rendered(prompt: list[int], text: str, model: str) -> dict[str, Any]:
        """A prompt as the render endpoints give it: vLLM's `GenerateRequest` fields that describe it
        (`token_ids`, what routers route on; `model`), and, as vLLM's earlier render did, its text and
        `prompt_token_ids`."""
        return {"request_id": f"render-{uuid.uuid4().hex}", "token_ids": prompt, "model": model,
                "prompt": text, "prompt_token_ids": prompt}

    def default_max_tokens(self, requested: int | None, prompt_len: int) -> int:
        if requested is not None:
            return requested
        return max(1, self.config.max_model_len - prompt_len)

    @staticmethod
    def sampling(body: SamplingFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                 choice_index: int = 0, grammar: GrammarSpec | None = None,
                 thinking: tuple[int, int] | None = None) -> SamplingParams:
        """`choice_index`: which of the request's n choices (with a seed, each draws from its own stream,
        derived by the engine). `thinking`: (budget, end token) when the thinking has a token budget."""
        bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k in (None, 0) else min(body.top_k, MAX_TOP_K),
            min_p=body.min_p or 0.0, seed=body.seed, choice_index=choice_index,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, logit_bias=bias,
            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, min_tokens=body.min_tokens, grammar=grammar,
            thinking_budget=thinking[0] if thinking else None, thinking_end_token=thinking[1] if thinking else None)

    @staticmethod
    def output_options(body: SamplingFields, reasoning_end_token: int | None = None, tool_calls: bool = False,
                       parallel_tool_calls: bool = True, inside_tool_calls: bool = False) -> OutputOptions:
        return OutputOptions(stop=tuple(body.stop_list()),
                             include_stop_str_in_output=body.include_stop_str_in_output or body.no_stop_trim,
                             skip_special_tokens=body.skip_special_tokens, reasoning_end_token=reasoning_end_token,
                             min_tokens=body.min_tokens, tool_calls=tool_calls, parallel_tool_calls=parallel_tool_calls,
                             inside_tool_calls=inside_tool_calls)

    def generation(self, request_id: str, prompt: list[int], body: SamplingFields, max_tokens: int,
                   logprobs: int | None, options: OutputOptions, prompt_logprobs: int | None = None,
                   grammar: GrammarSpec | None = None, thinking_budget: int | None = None,
                   prompts: int = 1) -> Generation:
        """The n choices of one prompt (not yet submitted; `prompts`: how many the API request has). The
        prompt's logprobs are the same for every choice: only the first computes them
        (`Generation.prompt_logprobs`); the others start after it and reuse its prefix from the cache like
        any sibling. A hand-over (prefill and decode apart) is made by the first choice too."""
        if self.image_id is not None and self.image_id in prompt:
            raise ApiError(400, "images are not read yet: v4serve serves DeepSeek-V4.1's text model, not its vision "
                                "tower; send the request without image parts")
        tenant = CURRENT_TENANT.get()
        salt = scoped_salt(tenant if self.config.isolate_tenants else None, body.cache_salt)
        handover, source = request_transfer(self.config.handovers, body.kv_transfer_params, body.stream, prompts)
        if body.bootstrap_room is not None:
            handover, source = sglang_transfer(self.config.handovers, body.bootstrap_host, body.bootstrap_port,
                                               body.bootstrap_room)
            if handover is not None:  # SGLang's prefill leg asks for the whole answer; the decode leg gives it
                max_tokens = 1
                body = body.model_copy(update={"min_tokens": min(body.min_tokens, 1)})
        requests = [EngineRequest(f"{request_id}-{i}", list(prompt),
                                  self.sampling(body, max_tokens, logprobs, prompt_logprobs if i == 0 else None,
                                                choice_index=i, grammar=grammar,
                                                thinking=self._thinking(thinking_budget)),
                                  cache_salt=salt, swa_cache_mode=body.swa_cache_mode,
                                  handover=handover if i == 0 else None, kv_source=source) for i in range(body.n)]
        generation = Generation(self.engine, self.metrics, self.tokenizer, requests, options,
                                self.config.max_unread_tokens, self.config.max_logprob_entries,
                                self.config.unread_timeout, tenant or DEFAULT_TENANT)
        generation.handover_asked = bool(body.kv_transfer_params and body.kv_transfer_params.get("do_remote_decode"))
        generation.handover = handover
        return generation

    def _thinking(self, budget: int | None) -> tuple[int, int] | None:
        if budget is None:
            return None
        if self.think_end_id is None:
            raise ApiError(400, "this model's tokenizer has no single </think> token, so a thinking budget cannot "
                                "be enforced", param="thinking.budget_tokens")
        return budget, self.think_end_id

    async def encode_texts(self, texts: list[str], add_bos: bool = True) -> list[list[int]]:
        """Token ids of text prompts (BOS first unless asked not to), in a preprocessing worker."""
        return [p.tolist() for p in await self.prep.run(jobs.encode_texts, texts, add_bos, self.config.max_model_len)]

    async def encode_chat(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        """Token ids of a conversation in DeepSeek-V4's prompt format, in a preprocessing worker."""
        return (await self.prep.run(jobs.encode_chat, messages, self.config.max_model_len, **options)).tolist()

    def token_text(self, token: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    async def check(self, generations: list[Generation], raw: Request | None = None) -> None:
        """Raise now if the engine cannot take these (so errors come before a stream's first byte). A
        grammar not compiled yet compiles here, on a grammar compiler thread: a flood of new schemas
        queues there instead of taking the threads that tokenize and validate everyone's requests, and
        one queued for a client that has gone (`raw` disconnected) never starts."""
        requests = [r for g in generations for r in g.requests]
        self._check_cost(generations)
        silent = self.engine.silent_for()
        if silent > self.config.stall_timeout:  # it would only wait: say so now, as /health does
            raise ApiError(503, f"engine not responding for {silent:.0f} s (its current step has not finished); "
                                "retry later", "server_error", code="engine_stalled", headers={"Retry-After": "5"})
        if any(r.sampling.grammar is not None for r in requests):
            await self._unless_gone(self._compilers.submit(self.engine.check, requests), raw)
        else:
            self.engine.check(requests)

    def _check_cost(self, generations: list[Generation]) -> None:
        """The tokens a request may make the engine compute, before any of it runs: each prompt once (its
        siblings reuse it from the cache) and each choice's max_tokens."""
        ceiling = self.config.max_request_tokens
        if ceiling is None:
            return
        cost = sum(g.requests[0].num_prompt_tokens + sum(r.sampling.max_tokens for r in g.requests)
                   for g in generations)
        if cost > ceiling:
            self.metrics.count_limited("request_tokens")
            raise ApiError(400, f"this request may cost {cost} tokens (its prompts plus n × max_tokens, a missing "
                                f"max_tokens counting as the rest of the context); at most {ceiling} "
                                "(--max-request-tokens): set or lower max_tokens, or lower n", param="max_tokens")

    @staticmethod
    async def _unless_gone(work: concurrent.futures.Future, raw: Request | None) -> None:
        """Wait for `work`; if the client goes meanwhile, cancel it (work not started never starts; a compile
        under way finishes, within llguidance's limits, and is kept for the next request that needs it)."""
        waiting = asyncio.wrap_future(work)
        while True:
            done, _ = await asyncio.wait([waiting], timeout=DISCONNECT_POLL)
            if done:
                return waiting.result()
            if raw is not None and await raw.is_disconnected():
                work.cancel()
                raise ApiError(499, "client disconnected")

    async def collect(self, generation: Generation, raw: Request) -> list[list[Delta]]:
        """All deltas of every choice (non-streaming); aborts if the client disconnects meanwhile. A
        prefill replica's reply waits for its hand-over to be on disk (`Handovers.reply_params`)."""
        per_choice: list[list[Delta]] = [[] for _ in generation.requests]

        async def consume() -> None:
            async with contextlib.aclosing(generation.deltas()) as deltas:
                async for delta in deltas:
                    if delta.error and delta.error_param:
                        raise ApiError(400, delta.error, param=delta.error_param)
                    if delta.error:
                        raise ApiError(500, delta.error, "server_error", code="generation_failed")
                    per_choice[delta.index].append(delta)

        task = asyncio.ensure_future(consume())
        while not task.done():
            await asyncio.wait([task], timeout=DISCONNECT_POLL)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ApiError(499, "client disconnected")
        task.result()
        if generation.handover is not None and self.config.handovers is not None:
            generation.kv_transfer_params = await self.config.handovers.reply_params(generation.handover)
        return per_choice
