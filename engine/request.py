"""One request object carries all per-request state, from arrival to finish."""

from __future__ import annotations

import enum
import hashlib
import time
from array import array
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from v4serve.cache.config import CacheConfig
from v4serve.cache.kv_transfer import KVSource
from v4serve.cache.request_kv import RequestKV

if TYPE_CHECKING:
    import numpy as np


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # its cached prefix is being read from the SSD store
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request failed (its sampling, or the step it was in); others go on

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.LOADING, RequestStatus.RUNNING)


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match (compiled and enforced by `engine.structured`)."""

    kind: Literal["json_schema", "lark"]
    text: str  # the JSON schema (serialized) or the Lark grammar
    param: str  # the request field it came from, for errors
    # Thinking mode: the grammar applies only after this token (`</think>`) has been generated.
    after_token: int | None = None


@dataclass
class Sample:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the top `logprobs` alternatives, best first


class TokenGrammar(Protocol):
    """One request's place in its grammar, as the sampler and the engine use it (built from a
    `GrammarSpec` by `engine.structured`, which imports this module, not the other way round)."""

    @property
    def active(self) -> bool:
        """The grammar constrains the next token (in thinking mode, only after `</think>`)."""

    @property
    def done(self) -> bool:
        """The grammar has ended: the request is complete."""

    def allowed_bitmask(self) -> np.ndarray:
        """The tokens allowed next, as int32 words: token t is bit t % 32 of word t // 32."""

    def accept(self, token: int) -> None:
        """Advance past a sampled token (RequestError if the grammar forbids it)."""

    def draftable(self, drafts: list[int]) -> list[int]:
        """Speculative drafts cut to those it allows and after none of which it would be done."""

    def allowed_after(self, drafted: list[int]) -> np.ndarray:
        """`allowed_bitmask` after these drafts, the grammar left where it was."""


GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_SEED = 2**63 - 1  # torch generators take seeds up to this
# Any top_k past the vocabulary keeps every token; larger ones are clamped to this, which crosses
# the engine-process boundary (64-bit integers) and means the same.
MAX_TOP_K = 2**31 - 1
MAX_CHOICE_INDEX = MAX_SEED  # hashed as 8 bytes beside the seed


def choice_seed(seed: int, choice_index: int) -> int:
    """The generator seed of choice `choice_index` of a request seeded `seed`. Choice 0 keeps the client's
    seed, so n = 1 outputs are what they always were; the others hash (seed, index), so every choice has
    a stream of its own: with seed + index, seeds s and s + 1 shared n − 1 choices."""
    if choice_index == 0:
        return seed
    key = seed.to_bytes(8, "little") + choice_index.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"v4serve-choice").digest(), "little") & MAX_SEED


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop tokens are not sampled before this many output tokens
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    # Which of the request's n choices this is: with a seed, each choice draws from its own stream
    # (`choice_seed`), so the front end sends every choice the client's seed unchanged.
    choice_index: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per sampled token (0 = only the chosen one)
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None  # structured output: a token mask at every step
    # Thinking mode's budget: after this many output tokens without `thinking_end_token`, that token is
    # the only one allowed (the thinking ends there; a grammar waiting for it starts).
    thinking_budget: int | None = None
    thinking_end_token: int | None = None

    @property
    def generator_seed(self) -> int | None:
        """The seed of this choice's own generator (None: it draws from the engine's shared one)."""
        return None if self.seed is None else choice_seed(self.seed, self.choice_index)

    @property
    def greedy(self) -> bool:
        # Below this, scaling by 1/temperature only overflows; the argmax is what it converges to.
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    swa_cache_mode: str | None = None  # how it writes window snapshots (None: the daemon's --swa-cache-mode)
    # Prefill and decode apart (cache/kv_transfer.py). A prefill replica's request hands its prompt's KV
    # over under this transfer id once all but the last prompt token are computed; a decode replica's
    # fetches it from `kv_source` before it is scheduled.
    handover: str | None = None
    kv_source: KVSource | None = None

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Its cache state (slot, block table, hashes, hit bounds, disk load): set by the scheduler
    # on arrival, read and changed only by `cache/`.
    kv: RequestKV = field(default_factory=lambda: RequestKV(root=b""))
    num_cached_tokens: int = 0  # prompt tokens whose computation a cache hit skipped
    num_hit_tokens: int = 0  # prompt tokens whose compressed entries came from the cache
    num_disk_hit_tokens: int = 0  # of those, tokens read from the SSD store for this request
    num_recomputed_tokens: int = 0  # tokens recomputed to rebuild the window state after a hit
    num_preemptions: int = 0
    # Held by the front end (its client is not reading what it made): the scheduler skips it until
    # it is resumed; it keeps its cache meanwhile (and may be preempted like any request).
    paused: bool = False
    # Speculative decoding: decode steps left without drafts, and how many the next miss skips (a pass
    # whose drafts were all rejected doubles it, up to MAX_DRAFT_BACKOFF; one that kept a draft resets it).
    draft_pause: int = 0
    draft_backoff: int = 0
    # Drafts the multi-token-prediction layer made (engine/mtp.py), valid while the request has
    # `mtp_drafts_at` tokens.
    mtp_drafts: list[int] = field(default_factory=list)
    mtp_drafts_at: int = -1
    # Async scheduling: tokens sampled on the device that the host has not read yet (0 or 1). Its next
    # step takes them as input on the device; `output_token_ids` gets them one step later.
    pending_tokens: int = 0
    # One entry per prompt token from the second on (the first has none), when asked for.
    prompt_logprobs: list = field(default_factory=lambda: [None])
    grammar: TokenGrammar | None = None  # its matcher, when sampling.grammar is set
    first_token_time: float | None = None
    finish_reason: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a hot path for long prompts)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return list(self.prompt_token_ids[start:end])
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return [*self.prompt_token_ids[start:], *self.output_token_ids[:end - p]]

    def hold_prompt_compactly(self) -> None:
        """The prompt's ids as machine integers (`array`), not a list of int objects: 8 bytes a token
        instead of ~36, and nothing the cycle collector walks (its full passes visited every prompt
        token of every request: a 50-100 ms step at 128 requests x 64K tokens)."""
        if not isinstance(self.prompt_token_ids, array):
            self.prompt_token_ids = array("q", self.prompt_token_ids)  # type: ignore[assignment]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1


class RequestError(ValueError):
    """A request the engine cannot serve as given (the server answers 400)."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True)
class RequestLimits:
    """What the engine can serve, fixed at start: requests are checked against it on any thread
    (before a stream's first byte) without touching the engine."""

    vocab_size: int
    max_model_len: int
    cache: CacheConfig

    def check_token_ids(self, ids: Iterable[int], param: str) -> None:
        # min and max in C first (a 64K-token prompt: ~1 ms, where a loop in Python took ~3 at its arrival
        # on the engine thread); the loop only names the first id out of range.
        held = ids if isinstance(ids, Collection) else list(ids)
        if not held or (0 <= min(held) and max(held) < self.vocab_size):
            return
        bad = next(t for t in held if not 0 <= t < self.vocab_size)
        raise RequestError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})", param=param)

    def validate(self, request: Request) -> None:
        """Cheap checks first: a huge prompt is rejected by its length before its ids are read."""
        prompt, params = request.prompt_token_ids, request.sampling
        if not prompt:
            raise RequestError("the prompt is empty", param="prompt")
        if params.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", param="max_tokens")
        if not 0 <= params.min_tokens <= params.max_tokens:
            raise RequestError(f"min_tokens must be between 0 and max_tokens ({params.max_tokens})", param="min_tokens")
        if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
            raise RequestError(f"seed must be between 0 and {MAX_SEED}", param="seed")
        if not 0 <= params.choice_index <= MAX_CHOICE_INDEX:
            raise RequestError(f"the choice index must be between 0 and {MAX_CHOICE_INDEX}", param="n")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({len(prompt)} in the messages, {params.max_tokens} in the "
                f"completion). Please reduce the length of the messages or completion.",
                code="context_length_exceeded", param="messages")
        if self.cache.blocks_needed(total) > self.cache.num_blocks:
            raise RequestError(f"the request needs {total} tokens of KV cache, more than the "
                               f"{self.cache.num_blocks} blocks configured", code="context_length_exceeded")
        self.check_token_ids(prompt, "prompt")
        self.check_token_ids(params.logit_bias, "logit_bias")
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
