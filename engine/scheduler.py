"""Token-budget continuous batching.

One rule covers every case: a request is `num_computed_tokens` catching up with its tokens. Each
step hands out a token budget: running decodes first (one token each), then running prefills
(chunked), then new requests in arrival order, each admitted only when a State Cache slot and
the blocks for its first chunk are available. A prefix hit simply starts a request with some
tokens already computed; a preempted request goes back to the queue and resumes by the same rule
(usually hitting its own cached blocks).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from v4serve.cache.kv_manager import NO_HIT, KVCacheManager
from v4serve.engine.request import Request, RequestStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int = 1024  # one request's prefill tokens per step
    max_model_len: int = 32768
    max_waiting: int = 1024


@dataclass
class ScheduledChunk:
    request: Request
    num_new: int

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the request's last known token (so a token is sampled)."""
        return self.request.num_computed_tokens + self.num_new == self.request.num_tokens


@dataclass
class SchedulerStats:
    prefix_queries: int = 0  # prompt tokens looked up
    prefix_hits: int = 0  # prompt tokens whose entries came from device memory
    prefix_hits_disk: int = 0  # prompt tokens whose entries were read from the SSD store
    recomputed: int = 0  # tokens recomputed to rebuild window state after hits
    preemptions: int = 0
    load_seconds: list[float] = field(default_factory=list)  # per-request store reads, drained by metrics


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.loading: list[Request] = []
        self.running: list[Request] = []
        self.stats = SchedulerStats()

    # ---- queue changes ------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.block_hashes = self.kv.hashes(request.all_token_ids, request.cache_salt)
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Leave the queues and give back the slot and blocks at once."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.loading:
            self.loading.remove(request)
        self.kv.free(request.slot, request.block_table)
        request.slot = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # ---- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        self._finish_loads()
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for request in self._running_decodes_first():
            if request.status is not RequestStatus.RUNNING or budget <= 0:
                continue
            n = self._chunk_size(request, request.num_computed_tokens, budget)
            if n <= 0 or not self._grow_or_preempt(request, n, chunks):
                continue
            chunks.append(ScheduledChunk(request, n))
            budget -= n
        self._admit(chunks, budget)
        return chunks

    def _running_decodes_first(self) -> list[Request]:
        return sorted(self.running, key=lambda r: r.is_prefill)

    def _chunk_size(self, request: Request, start: int, budget: int) -> int:
        n = min(request.num_tokens - start, budget, self.config.max_prefill_chunk)
        # A prefill chunk ends on the next snapshot point so the state there can be saved; while a
        # hit's window state is being rebuilt it is not exact until the hit boundary.
        lo = max(start, request.frozen_until - 1) if request.window_from else start
        point = self.kv.next_snapshot_point(lo, request.num_prompt_tokens, start + n - 1)
        return n if point is None else point - start

    def _grow_or_preempt(self, request: Request, n: int, scheduled: list[ScheduledChunk]) -> bool:
        """Blocks for the next n tokens, preempting the newest other running requests if
        needed; False if the request itself had to be preempted."""
        while not self.kv.grow(request.block_table, request.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim, scheduled)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, scheduled: list[ScheduledChunk]) -> None:
        scheduled[:] = [c for c in scheduled if c.request is not request]
        self.running.remove(request)
        self.kv.free(request.slot, request.block_table)
        request.slot = None
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_sealed_blocks = 0
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            plan = self.kv.plan_prefix(request.block_hashes, request.num_tokens)
            if request.sampling.prompt_logprobs is not None:
                plan = NO_HIT  # every prompt row's logits are wanted: nothing may be skipped
            elif self._start_disk_load(request, len(plan.hit_blocks)):
                continue
            request.frozen_until, request.window_from = plan.hit_tokens, plan.window_from
            n = self._chunk_size(request, plan.resume_from, budget)
            admitted = self.kv.admit(plan, plan.resume_from + n)
            if admitted is None:
                break  # head of line waits for slots/blocks; arrival order is kept
            self.waiting.popleft()
            request.slot, request.block_table = admitted
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = plan.resume_from
            request.num_sealed_blocks = len(plan.hit_blocks)
            if request.num_preemptions == 0:
                request.num_hit_tokens = plan.hit_tokens
                request.num_cached_tokens = plan.resume_from
                request.num_recomputed_tokens = plan.recompute_tokens
                request.num_disk_hit_tokens = min(request.num_disk_hit_tokens, plan.hit_tokens)
                self.stats.prefix_queries += request.num_prompt_tokens
                self.stats.prefix_hits += plan.hit_tokens - request.num_disk_hit_tokens
                self.stats.prefix_hits_disk += request.num_disk_hit_tokens
            self.stats.recomputed += plan.recompute_tokens
            self.running.append(request)
            chunks.append(ScheduledChunk(request, n))
            budget -= n

    # ---- the SSD store ----------------------------------------------------------------------------
    def _start_disk_load(self, request: Request, device_hit: int) -> bool:
        """Once per request: if the store holds blocks past the device hit, read them in the
        background while the request waits in LOADING (others keep running)."""
        if request.disk_checked or self.kv.store is None:
            return False
        request.disk_checked = True
        count = self.kv.disk_blocks(request.block_hashes, request.num_tokens, device_hit)
        if not count:
            return False
        self.waiting.popleft()
        request.status = RequestStatus.LOADING
        request.disk_load = self.kv.start_load(request.block_hashes, request.all_token_ids, device_hit, count)
        self.loading.append(request)
        return True

    def _finish_loads(self) -> None:
        done = [r for r in self.loading if r.disk_load.done()]
        for request in sorted(done, key=lambda r: r.arrival_time, reverse=True):
            self.loading.remove(request)
            load, request.disk_load = request.disk_load, None
            try:
                result = load.result()
            except Exception:  # a failed read is a miss: the request computes instead
                log.exception("reading %s's prefix from the KV store failed", request.request_id)
            else:
                installed = self.kv.install(result, request.block_hashes)
                request.num_disk_hit_tokens = installed * self.kv.config.block_size
                self.stats.load_seconds.append(result.seconds)
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    # ---- after the forward ----------------------------------------------------------------------
    def advance(self, chunks: Iterable[ScheduledChunk]) -> None:
        """Account computed tokens: seal full blocks, save state snapshots at their points."""
        b = self.kv.config.block_size
        for chunk in chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.num_new
            pos = request.num_computed_tokens
            if pos // b > request.num_sealed_blocks:
                first = request.num_sealed_blocks * b
                request.num_sealed_blocks = self.kv.seal(request.block_table, request.block_hashes,
                                                         request.num_sealed_blocks, pos,
                                                         request.token_slice(first, pos // b * b), first)
            exact = request.window_from == 0 or pos >= request.frozen_until
            if exact and self.kv.is_snapshot_point(pos, request.num_prompt_tokens):
                key = request.block_hashes[pos // b - 1]
                self.kv.save_snapshot(request.slot, key, request.token_slice(pos - b, pos))

    def append_token(self, request: Request, token: int) -> None:
        request.output_token_ids.append(token)
        if request.num_tokens % self.kv.config.block_size == 0:  # a block of known tokens completed
            self.kv.extend_hashes(request.block_hashes, request.all_token_ids, request.cache_salt)
