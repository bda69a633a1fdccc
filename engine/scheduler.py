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
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from v4serve.cache.config import MAX_CAPTURED_STATES
from v4serve.cache.kv_manager import KVCacheManager
from v4serve.cache.kv_transfer import KVTransferConfig
from v4serve.cache.ssd_loader import LOAD_PHASES, DiskLoad
from v4serve.engine.request import Request, RequestStatus
from v4serve.engine.stats import Histogram

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int = 1024  # one request's prefill tokens per step
    max_model_len: int = 32768
    max_waiting: int = 1024
    max_captured_states: int = MAX_CAPTURED_STATES  # slot states a step may capture inside its chunks
    kv_transfer: KVTransferConfig | None = None  # prefill and decode apart (None: neither role)


@dataclass
class ScheduledChunk:
    request: Request
    num_new: int  # tokens computed, drafts included
    drafts: tuple[int, ...] = ()  # speculative tokens after the request's last one, checked by this pass
    # Snapshot points strictly inside the chunk: the step captures the slot states there
    # (cache/state_capture.py) instead of ending the chunk on each.
    capture_points: tuple[int, ...] = ()
    # Whether this chunk reaches the request's last known token (so a token is sampled): decided as it is
    # scheduled, before the step's tokens are accounted (`_chunk`). A field, not a property: every step
    # reads it several times for each sequence.
    completes: bool = False


@dataclass
class SchedulerStats:
    prefix_queries: int = 0  # prompt tokens looked up
    prefix_hits: int = 0  # prompt tokens whose entries came from device memory
    prefix_hits_disk: int = 0  # prompt tokens whose entries were read from the SSD store
    recomputed: int = 0  # tokens recomputed to rebuild window state after hits
    preemptions: int = 0
    restores: Counter = field(default_factory=Counter)  # how hits restored the window state, by point
    write_modes: Counter = field(default_factory=Counter)  # admissions by how they write snapshots (auto resolved)
    load_seconds: Histogram = field(default_factory=Histogram.for_store_reads)  # per-request store reads
    # ... and where each one's time went (cache/ssd_loader.LOAD_PHASES)
    load_phases: dict[str, Histogram] = field(
        default_factory=lambda: {p: Histogram.for_store_reads() for p in LOAD_PHASES})
    # Prefill and decode apart: prompts handed over (prefill side; failed: no store room or queue), and
    # hand-overs fetched (decode side): files and bytes brought in, how many from a shared store's own
    # disk, the fetches that fell short by reason (what was missing was computed), and their seconds.
    handovers: int = 0
    handover_failures: int = 0
    fetches: int = 0
    fetched_files: int = 0
    fetched_bytes: int = 0
    fetches_local: int = 0
    fetch_fallbacks: Counter = field(default_factory=Counter)
    fetch_seconds: Histogram = field(default_factory=Histogram.for_store_reads)


# A decoding request's draft tokens for this step, given the most it may take (speculative decoding).
Drafter = Callable[[Request, int], list[int]]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, drafter: Drafter | None = None,
                 eos_token_id: int | None = None) -> None:
        self.config = config
        self.kv = kv
        self.drafter = drafter
        self.eos_token_id = eos_token_id  # drafts stop before it
        self.waiting: deque[Request] = deque()
        self.loading: list[Request] = []
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._states_left = config.max_captured_states  # this step's, while it is being scheduled

    # ---- queue changes ------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.kv = self.kv.new_request(request.cache_salt, request.num_tokens, request.token_slice,
                                         request.swa_cache_mode)
        if request.kv_source is not None and self._start_fetch(request):
            return
        self.waiting.append(request)
        if self.kv.reads_from_store and request.sampling.prompt_logprobs is None:
            # Its prefix's files are read from now on, while the requests ahead of it run.
            self.kv.plan_prefix(request.kv, request.num_tokens, request.token_slice, admitting=False)
            self._start_disk_load(request, admitting=False)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Leave the queues and give back the slot and blocks at once; a response that ended
        normally leaves its state behind for the conversation's next turn."""
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) and request in self.running:
            self.kv.save_response_end(request.kv, request.num_computed_tokens, request.token_slice)
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.loading:
            self.loading.remove(request)
        self.kv.free(request.kv)

    @property
    def fetching(self) -> int:
        """Requests waiting for their hand-over to be fetched."""
        return sum(r.kv.fetch is not None for r in self.loading)

    def has_work(self) -> bool:
        """Anything to compute: paused requests alone are not (the engine waits instead of spinning)."""
        return bool(self.waiting or self.loading or any(not r.paused for r in self.running))

    # ---- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        self._finish_loads()
        budget = self.config.max_num_batched_tokens
        self._states_left = self.config.max_captured_states
        chunks: list[ScheduledChunk] = []
        for request in self._running_decodes_first():
            if request.status is not RequestStatus.RUNNING or request.paused or budget <= 0:
                continue
            if request.pending_tokens and self._ends_on_pending(request):
                continue  # its token in flight is its last (by length): nothing more to compute
            drafts = self._drafts(request, budget)
            n, points = self._chunk_size(request, request.num_computed_tokens, budget, len(drafts))
            drafts = drafts[:max(0, n - (request.num_tokens - request.num_computed_tokens))]
            if n <= 0 or not self._grow_or_preempt(request, n, chunks):
                continue
            chunks.append(self._chunk(request, n, tuple(drafts), points))
            budget -= n
        self._admit(chunks, budget)
        return chunks

    def _ends_on_pending(self, request: Request) -> bool:
        ahead = request.num_tokens + request.pending_tokens
        return (len(request.output_token_ids) + request.pending_tokens >= request.sampling.max_tokens
                or ahead >= self.config.max_model_len)

    def _running_decodes_first(self) -> list[Request]:
        return sorted(self.running, key=lambda r: r.is_prefill)

    def _chunk_size(self, request: Request, start: int, budget: int, drafts: int = 0) -> tuple[int, tuple[int, ...]]:
        """(tokens of the request's next chunk, the snapshot points inside it whose states it captures)."""
        if not drafts and request.num_tokens + request.pending_tokens - start == 1 and budget > 0:
            return 1, ()  # a decode step: one token, nothing strictly inside it to capture (the common case)
        n = min(request.num_tokens + drafts - start, budget, self.config.max_prefill_chunk)
        if request.handover is not None and start < request.num_prompt_tokens - 1:
            n = min(n, request.num_prompt_tokens - 1 - start)  # what is handed over: the state before the last token
        # A drafted pass may be undone, so no state inside it is captured: it ends on snapshot points.
        n = self.kv.chunk_size(request.kv, start, n, request.num_prompt_tokens, capture=not drafts)
        points = () if drafts else self.kv.capture_points(request.kv, start, start + n, request.num_prompt_tokens)
        if len(points) > self._states_left:  # the step's allowance is spent: end on the next point
            n = points[self._states_left] - start
            points = points[:self._states_left]
        return n, points

    def _chunk(self, request: Request, n: int, drafts: tuple[int, ...], points: tuple[int, ...]) -> ScheduledChunk:
        self._states_left -= len(points)
        completes = (request.num_computed_tokens + n - len(drafts)
                     == len(request.prompt_token_ids) + len(request.output_token_ids) + request.pending_tokens)
        return ScheduledChunk(request, n, drafts, points, completes)

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request, cut so that none of them could end it: an accepted draft
        is never a stop token, never the last token allowed and never one that completes the request's
        grammar (only the pass's own sample may end it); a grammar still waiting for `</think>` takes none."""
        params = request.sampling
        # Only past the prompt: a request catching up on output tokens (after a rejected draft) drafts on.
        decoding = request.output_token_ids and request.num_computed_tokens >= request.num_prompt_tokens
        grammar = request.grammar
        if self.drafter is None or not decoding or (grammar is not None and not grammar.active):
            return []
        if request.draft_pause:  # its recent drafts were all rejected: a few plain steps first
            request.draft_pause -= 1
            return []
        most = min(budget - 1, params.max_tokens - len(request.output_token_ids) - 1,
                   self.config.max_model_len - request.num_tokens - 1)
        if most <= 0:
            return []
        drafts = self.drafter(request, most)[:most]
        if grammar is not None:  # only drafts it allows, none after which it would be done
            drafts = grammar.draftable(drafts)
        ends = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            ends.add(self.eos_token_id)
        for i, token in enumerate(drafts):
            if token in ends:
                return drafts[:i]
        return drafts

    def _grow_or_preempt(self, request: Request, n: int, scheduled: list[ScheduledChunk]) -> bool:
        """Blocks for the next n tokens, preempting the newest other running requests if
        needed; False if the request itself had to be preempted, or has to wait. A request with a token
        in flight (async scheduling) is never preempted: that token is valid and not yet known."""
        while not self.kv.grow(request.kv, request.num_computed_tokens + n):
            victim = next((r for r in reversed(self.running) if not r.pending_tokens), None)
            if victim is None:
                return False  # the blocks come back once the tokens in flight are known
            self._preempt(victim, scheduled)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, scheduled: list[ScheduledChunk]) -> None:
        scheduled[:] = [c for c in scheduled if c.request is not request]
        self.running.remove(request)
        self.kv.free(request.kv)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            # Every prompt row's logits wanted (prompt logprobs): nothing may be skipped.
            reuse = request.sampling.prompt_logprobs is None
            plan = self.kv.plan_prefix(request.kv, request.num_tokens, request.token_slice, reuse)
            if reuse and self._start_disk_load(request):
                continue
            n, points = self._chunk_size(request, plan.resume_from, budget)
            if not self.kv.admit(request.kv, plan.resume_from + n):
                break  # head of line waits for slots/blocks; arrival order is kept
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = plan.resume_from
            if request.num_preemptions == 0:
                request.num_hit_tokens = plan.hit_tokens
                request.num_cached_tokens = plan.resume_from
                request.num_recomputed_tokens = plan.recompute_tokens
                request.num_disk_hit_tokens = min(request.kv.disk_tokens, plan.hit_tokens)
                self.stats.prefix_queries += request.num_prompt_tokens
                self.stats.prefix_hits += plan.hit_tokens - request.num_disk_hit_tokens
                self.stats.prefix_hits_disk += request.num_disk_hit_tokens
                if plan.restore_point is not None:
                    self.stats.restores[plan.restore_point] += 1
                self.stats.write_modes[self.kv.snapshot_mode(request.kv)] += 1
            self.stats.recomputed += plan.recompute_tokens
            self.running.append(request)
            self._hand_over_if_due(request)  # a hit may restore the state the hand-over needs
            chunks.append(self._chunk(request, n, (), points))
            budget -= n

    # ---- the SSD store ----------------------------------------------------------------------------
    def _start_disk_load(self, request: Request, admitting: bool = True) -> bool:
        """If the SSD store holds blocks past the device hit, the request waits in LOADING while they
        are read in the background (others keep running)."""
        if not self.kv.start_disk_load(request.kv, request.num_tokens, request.token_slice, admitting):
            return False
        self.waiting.remove(request)
        request.status = RequestStatus.LOADING
        self.loading.append(request)
        return True

    def pending_loads(self) -> list[Future]:
        """The store reads and hand-over fetches the loading requests wait for."""
        return [f for r in self.loading if (f := r.kv.disk_load or r.kv.fetch) is not None]

    def _finish_loads(self) -> None:
        done = [r for r in self.loading if (f := r.kv.disk_load or r.kv.fetch) is not None and f.done()]
        for request in done:
            self.loading.remove(request)
            if request.kv.fetch is not None:
                self._finish_fetch(request)
            else:
                try:
                    self._observe_load(request, self.kv.finish_disk_load(request.kv))
                except Exception:  # a failed read is a miss: the request computes instead
                    log.exception("reading %s's prefix from the SSD store failed", request.request_id)
            request.status = RequestStatus.WAITING
            self._rejoin(request)

    def _rejoin(self, request: Request) -> None:
        """Back in the queue where its arrival puts it: a read started at arrival jumps no one."""
        later = next((i for i, r in enumerate(self.waiting) if r.arrival_time > request.arrival_time), None)
        if later is None:
            self.waiting.append(request)
        else:
            self.waiting.insert(later, request)

    def _observe_load(self, request: Request, load: DiskLoad) -> None:
        self.stats.load_seconds.observe(load.seconds)
        for phase in LOAD_PHASES:
            self.stats.load_phases[phase].observe(load.phases.get(phase, 0.0))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %d blocks from the SSD store in %.1f ms (%s; read and verify are thread seconds)",
                      request.request_id, len(load.hashes), 1000 * load.seconds,
                      ", ".join(f"{p} {1000 * load.phases.get(p, 0.0):.1f} ms" for p in LOAD_PHASES))

    # ---- prefill and decode apart -------------------------------------------------------------------
    def _start_fetch(self, request: Request) -> bool:
        """A decode replica's request waits (LOADING) while its prompt's KV is fetched into the store; its
        admission then reads it as any disk hit. False (it computes its prompt) if this replica is no
        consumer or has no store."""
        transfer, source = self.config.kv_transfer, request.kv_source
        assert source is not None
        if transfer is None or not transfer.consumer or not self.kv.start_fetch(
                request.kv, source, request.token_slice, request.num_prompt_tokens, transfer):
            self.stats.fetch_fallbacks["store"] += 1
            log.warning("%s names a hand-over but this replica cannot fetch one: it computes its prompt",
                        request.request_id)
            return False
        request.status = RequestStatus.LOADING
        self.loading.append(request)
        return True

    def _finish_fetch(self, request: Request) -> None:
        s, source = self.stats, request.kv_source
        assert source is not None
        result = self.kv.finish_fetch(request.kv)
        s.fetches += 1
        s.fetched_files += result.files
        s.fetched_bytes += result.bytes
        s.fetches_local += int(result.local)
        s.fetch_seconds.observe(result.seconds)
        if result.fallback is not None:
            s.fetch_fallbacks[result.fallback] += 1
            log.warning("%s: the hand-over from %s:%d fell short (%s: %s); what is missing is computed here",
                        request.request_id, source.host, source.port, result.fallback, result.detail)

    def _hand_over_if_due(self, request: Request) -> None:
        """A prefill replica's request, once all but its last prompt token are computed (its slot state
        is then what the decode replica resumes from): its KV is handed over under its transfer id."""
        transfer, transfer_id = self.config.kv_transfer, request.handover
        if transfer_id is None or request.num_computed_tokens != request.num_prompt_tokens - 1:
            return
        request.handover = None
        if transfer is not None and self.kv.hand_over(request.kv, transfer_id, request.num_computed_tokens,
                                                       request.token_slice, transfer.hold_seconds):
            self.stats.handovers += 1
        else:
            self.stats.handover_failures += 1
            log.warning("%s: its KV could not be handed over (no store, or the store's write queue is full); "
                        "the decode replica will compute it", request.request_id)

    # ---- after the forward ----------------------------------------------------------------------
    def advance(self, chunks: Iterable[ScheduledChunk],
                captured: Mapping[str, Sequence[tuple[int, Any]]] | None = None) -> None:
        """Account computed tokens (the cache seals full blocks and takes due snapshots, with the
        states `captured` inside each request's chunk)."""
        for chunk in chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.num_new
            self.kv.advance(request.kv, request.num_computed_tokens, request.num_prompt_tokens, request.token_slice,
                            (captured or {}).get(request.request_id, ()))
            if request.handover is not None:
                self._hand_over_if_due(request)

    def append_token(self, request: Request, token: int) -> None:
        request.output_token_ids.append(token)
        if request.num_tokens % self.kv.config.block_size == 0:  # a block of known tokens completed
            self.kv.extend_hashes(request.kv, request.num_tokens, request.token_slice)
