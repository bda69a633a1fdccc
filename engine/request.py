"""One request object carries all per-request state, from arrival to finish."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # its cached prefix is being read from the SSD store
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per sampled token (0 = only the chosen one)
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    slot: int | None = None
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of every complete block of all tokens
    num_sealed_blocks: int = 0
    # Set by a prefix hit: entries below `frozen_until` come from the cache and are never
    # written; window KV below `window_from` is absent while it is rebuilt.
    frozen_until: int = 0
    window_from: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose computation a cache hit skipped
    num_hit_tokens: int = 0  # prompt tokens whose compressed entries came from the cache
    num_disk_hit_tokens: int = 0  # of those, tokens read from the SSD store for this request
    disk_checked: bool = False
    disk_load: Any = None  # the pending store read while LOADING
    num_recomputed_tokens: int = 0  # tokens recomputed to rebuild the window state after a hit
    num_preemptions: int = 0
    # One entry per prompt token from the second on (the first has none), when asked for.
    prompt_logprobs: list = field(default_factory=lambda: [None])
    first_token_time: float | None = None
    finish_reason: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a hot path for long prompts)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1
