"""Prometheus metrics, one registry per server (so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from v4serve.cache.ssd_store import ERROR_KINDS
from v4serve.engine.engine import LLMEngine
from v4serve.engine.request import Request

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Metrics:
    """Implements the engine's observer interface; counters advance by the scheduler's deltas."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, {"model_name": model_name}
        self._label = label

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ["model_name", *extra], registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model_name"], registry=r)

        self.prefix_queries = counter("v4serve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("v4serve_prefix_cache_hits", "Prompt tokens served from cache", ("source",))
        self.recompute = counter("v4serve_swa_recompute_tokens", "Tokens recomputed to restore window state")
        self.preemptions = counter("v4serve_num_preemptions", "Requests preempted for lack of blocks")
        self.evictions = counter("v4serve_block_cache_evictions", "Cached blocks evicted to make room")
        self.prompt_tokens = counter("v4serve_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("v4serve_generation_tokens", "Generated tokens")
        self.finished = counter("v4serve_request_success", "Finished requests", ("finished_reason",))
        self.state_usage = gauge("v4serve_state_cache_usage", "Fraction of State Cache slots in use")
        self.block_usage = gauge("v4serve_block_cache_usage", "Fraction of Block Cache blocks in use")
        self.running = gauge("v4serve_requests_running", "Requests in the running batch")
        self.waiting = gauge("v4serve_requests_waiting", "Requests waiting to be admitted")
        self.ttft = Histogram("v4serve_time_to_first_token_seconds", "Time to first token", ["model_name"],
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("v4serve_inter_token_latency_seconds", "Time between output tokens",
                             ["model_name"], buckets=_ITL, registry=r)
        self.e2e = Histogram("v4serve_e2e_request_latency_seconds", "Arrival to finish", ["model_name"],
                             buckets=_LATENCY, registry=r)
        self.store_read = counter("v4serve_kv_store_read_bytes", "Bytes read from the SSD prefix store")
        self.store_written = counter("v4serve_kv_store_written_bytes", "Bytes written to the SSD prefix store")
        self.store_errors = counter("v4serve_kv_store_errors", "SSD store faults (bad files, full disk)", ("kind",))
        self.store_usage = gauge("v4serve_kv_store_usage_bytes", "Bytes the SSD prefix store holds")
        self.store_read_seconds = Histogram("v4serve_kv_store_read_seconds", "Per-request SSD store load time",
                                            ["model_name"], buckets=_ITL, registry=r)
        # Every series exists from the start (at 0), so dashboards and rate() see it before the
        # first event.
        for metric in (self.prefix_queries, self.recompute, self.preemptions, self.evictions, self.prompt_tokens,
                       self.generation_tokens, self.store_read, self.store_written, self.state_usage,
                       self.block_usage, self.running, self.waiting, self.store_usage, self.ttft, self.itl,
                       self.e2e, self.store_read_seconds):
            metric.labels(**label)
        for source in ("device", "disk"):
            self.prefix_hits.labels(**label, source=source)
        for kind in ERROR_KINDS:
            self.store_errors.labels(**label, kind=kind)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(**label, finished_reason=reason)
        self._last = {"queries": 0, "hits": 0, "disk_hits": 0, "recompute": 0, "preemptions": 0, "evictions": 0,
                      "read": 0, "written": 0}
        self._last_errors: dict[str, int] = {}
        self._last_token: dict[str, float] = {}

    def on_step(self, engine: LLMEngine) -> None:
        stats, pool = engine.scheduler.stats, engine.kv.pool
        store = engine.kv.store
        now = {"queries": stats.prefix_queries, "hits": stats.prefix_hits, "disk_hits": stats.prefix_hits_disk,
               "recompute": stats.recomputed, "preemptions": stats.preemptions, "evictions": pool.evictions,
               "read": store.stats.bytes_read if store else 0, "written": store.stats.bytes_written if store else 0}
        delta = {k: now[k] - self._last[k] for k in now}
        self._last = now
        lb = self._label
        self.prefix_queries.labels(**lb).inc(delta["queries"])
        self.prefix_hits.labels(**lb, source="device").inc(delta["hits"])
        self.recompute.labels(**lb).inc(delta["recompute"])
        self.preemptions.labels(**lb).inc(delta["preemptions"])
        self.evictions.labels(**lb).inc(delta["evictions"])
        self.prefix_hits.labels(**lb, source="disk").inc(delta["disk_hits"])
        self.store_read.labels(**lb).inc(delta["read"])
        self.store_written.labels(**lb).inc(delta["written"])
        while stats.load_seconds:
            self.store_read_seconds.labels(**lb).observe(stats.load_seconds.pop())
        self.sample_queues(engine)

    def sample_queues(self, engine: LLMEngine) -> None:
        lb = self._label
        self.state_usage.labels(**lb).set(engine.kv.slots.usage())
        self.block_usage.labels(**lb).set(engine.kv.pool.usage())
        self.running.labels(**lb).set(len(engine.scheduler.running))
        self.waiting.labels(**lb).set(len(engine.scheduler.waiting) + len(engine.scheduler.loading))
        store = engine.kv.store
        if store is not None:
            # Store threads count faults as they happen: read them at every scrape too.
            self.store_usage.labels(**lb).set(store.used_bytes)
            for kind, count in list(store.stats.errors.items()):
                self.store_errors.labels(**lb, kind=kind).inc(count - self._last_errors.get(kind, 0))
                self._last_errors[kind] = count

    def on_token(self, request: Request, now: float, first: bool) -> None:
        lb = self._label
        self.generation_tokens.labels(**lb).inc()
        if first:
            self.ttft.labels(**lb).observe(now - request.arrival_time)
        elif request.request_id in self._last_token:
            self.itl.labels(**lb).observe(now - self._last_token[request.request_id])
        self._last_token[request.request_id] = now

    def on_finish(self, request: Request, now: float) -> None:
        lb = self._label
        self._last_token.pop(request.request_id, None)
        self.e2e.labels(**lb).observe(now - request.arrival_time)
        self.prompt_tokens.labels(**lb).inc(request.num_prompt_tokens)
        self.finished.labels(**lb, finished_reason=request.finish_reason or "abort").inc()
