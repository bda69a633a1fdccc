"""Prometheus metrics, one registry per server (so several servers can live in one process).

Two sources, neither of which reaches into the engine from the HTTP thread:
- the engine's immutable `EngineStats` snapshot, rendered at every scrape by a collector: its
  counters are the engine's own cumulative numbers, so a scrape can neither miss nor double-count;
- the front end's own request metrics (latency, tokens, finish reasons), observed on the event
  loop as token outputs arrive. With several API-server processes (`--api-server-count`) each
  process's values live in files of one folder (prometheus_client's multiprocess mode), summed at
  every scrape, so any process answers /metrics for all of them.
"""

from __future__ import annotations

import asyncio
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from v4serve.cache.kv_transfer import FALLBACK_REASONS
from v4serve.cache.ssd_file import ERROR_KINDS
from v4serve.cache.ssd_loader import LOAD_PHASES
from v4serve.engine.request import Request
from v4serve.engine.stats import EngineStats, HistogramSnapshot
from v4serve.engine.stats import Histogram as EngineHistogram
from v4serve.server.tenants import DEFAULT_TENANT

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
FINISH_REASONS = ("stop", "length", "abort")
RESTORE_POINTS = ("block", "snapshot", "response_end", "recompute")
WRITE_MODES = ("full", "periodic", "zero")

# (name, help, EngineStats field) of the snapshot's counters and gauges.
_COUNTERS = (
    ("v4serve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_queries"),
    ("v4serve_swa_recompute_tokens", "Tokens recomputed to restore window state after a hit", "recomputed_tokens"),
    ("v4serve_num_preemptions", "Requests preempted for lack of blocks", "preemptions"),
    ("v4serve_block_cache_evictions", "Cached blocks evicted to make room", "evictions"),
    ("v4serve_kv_store_read_bytes", "Bytes read from the SSD prefix store", "store_read_bytes"),
    ("v4serve_kv_store_written_bytes", "Bytes written to the SSD prefix store", "store_written_bytes"),
    # Speculative decoding, in vLLM's meanings: passes with drafts, drafts proposed, drafts accepted.
    ("v4serve_spec_decode_num_drafts", "Forward passes that checked drafts (speculative decoding)", "spec_drafts"),
    ("v4serve_spec_decode_num_draft_tokens", "Draft tokens proposed", "spec_draft_tokens"),
    ("v4serve_spec_decode_num_accepted_tokens", "Draft tokens accepted", "spec_accepted_tokens"),
)
_GAUGES = (
    ("v4serve_state_cache_usage", "Fraction of State Cache slots in use", "state_cache_usage"),
    ("v4serve_block_cache_usage", "Fraction of Block Cache blocks in use", "block_cache_usage"),
    ("v4serve_requests_running", "Requests in the running batch", "running"),
    ("v4serve_requests_waiting", "Requests waiting to be admitted (including SSD store reads)", "waiting"),
    ("v4serve_kv_transfer_fetching", "Requests waiting for their hand-over to be fetched from a prefill replica "
     "(not counted as waiting)", "fetching"),
    ("v4serve_kv_store_usage_bytes", "Bytes the SSD prefix store holds", "store_usage_bytes"),
    ("v4serve_kv_store_quarantine_files", "Bad SSD store files kept aside in quarantine/ (bounded)",
     "store_quarantine_files"),
)


# vLLM's names for the same numbers, read by routers and the Gateway API Inference Extension's endpoint
# picker: (name, help, kind, the value from a snapshot). Labelled as vLLM labels them (model_name, engine).
_VLLM_NAMES: tuple[tuple[str, str, str, Callable[[EngineStats], float]], ...] = (
    ("vllm:num_requests_running", "Requests in the running batch (v4serve_requests_running)", "gauge",
     lambda s: s.running),
    ("vllm:num_requests_waiting", "Requests waiting to be admitted (v4serve_requests_waiting)", "gauge",
     lambda s: s.waiting),
    ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use, 1 = full (v4serve_block_cache_usage)",
     "gauge", lambda s: s.block_cache_usage),
    # The name before vLLM 0.10, which older endpoint pickers still read.
    ("vllm:gpu_cache_usage_perc", "Fraction of KV cache blocks in use, 1 = full (v4serve_block_cache_usage)",
     "gauge", lambda s: s.block_cache_usage),
    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (v4serve_prefix_cache_queries)",
     "counter", lambda s: s.prefix_queries),
    ("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache, device and disk "
     "(v4serve_prefix_cache_hits)", "counter", lambda s: s.prefix_hits_device + s.prefix_hits_disk),
    ("vllm:num_preemptions", "Requests preempted (v4serve_num_preemptions)", "counter", lambda s: s.preemptions),
)


EMPTY_READS = EngineHistogram.for_store_reads().snapshot()


class EngineCollector:
    """Renders the latest engine snapshot at scrape time, under v4serve's names and vLLM's."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats],
                 cache_info: Mapping[str, object] | None = None) -> None:
        self.model_name, self.stats = model_name, stats
        self.cache_info = {k: str(v) for k, v in (cache_info or {}).items()}  # vllm:cache_config_info's labels

    def collect(self) -> Iterator[Metric]:
        s, name = self.stats(), [self.model_name]
        for metric, doc, attr in _COUNTERS:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, getattr(s, attr))
            yield family
        for metric, doc, attr in _GAUGES:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, getattr(s, attr))
            yield family
        hits = CounterMetricFamily("v4serve_prefix_cache_hits", "Prompt tokens served from cache",
                                   labels=["model_name", "source"])
        hits.add_metric([self.model_name, "device"], s.prefix_hits_device)
        hits.add_metric([self.model_name, "disk"], s.prefix_hits_disk)
        yield hits
        errors = CounterMetricFamily("v4serve_kv_store_errors", "SSD store faults (bad files, full disk)",
                                     labels=["model_name", "kind"])
        for kind in sorted(set(ERROR_KINDS) | set(s.store_errors)):
            errors.add_metric([self.model_name, kind], s.store_errors.get(kind, 0))
        yield errors
        restores = CounterMetricFamily("v4serve_prefix_cache_restores", "Prefix hits by how the window state was "
                                       "restored", labels=["model_name", "point"])
        for point in RESTORE_POINTS:
            restores.add_metric([self.model_name, point], s.restores.get(point, 0))
        yield restores
        snapshots = CounterMetricFamily("v4serve_swa_snapshot_bytes", "Window-state snapshot bytes written, by tier "
                                        "(host memory, the SSD store)", labels=["model_name", "tier"])
        snapshots.add_metric([self.model_name, "host"], s.snapshot_bytes_host)
        snapshots.add_metric([self.model_name, "disk"], s.snapshot_bytes_disk)
        yield snapshots
        modes = CounterMetricFamily("v4serve_swa_requests", "Admitted requests by how they wrote window snapshots "
                                    "(auto resolved: zero while cold, periodic once hot)",
                                    labels=["model_name", "mode"])
        for mode in WRITE_MODES:
            modes.add_metric([self.model_name, mode], s.write_modes.get(mode, 0))
        yield modes
        hot = GaugeMetricFamily("v4serve_swa_hot_prefixes", "Prefixes hot now (--swa-cache-mode auto: hit within "
                                "the hour, so requests through them snapshot)", labels=["model_name"])
        hot.add_metric(name, s.hot_prefixes)
        yield hot
        per_position = CounterMetricFamily("v4serve_spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted, by their place in the draft (0: first)",
                                           labels=["model_name", "position"])
        for position, accepted in enumerate(s.spec_accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], accepted)
        yield per_position
        grammar_bytes = GaugeMetricFamily("v4serve_grammar_cache_bytes", "Text bytes of the compiled grammars kept, by "
                                          "process (bounded by --grammar-cache-bytes each)",
                                          labels=["model_name", "process"])
        compiles = CounterMetricFamily("v4serve_grammar_compiles", "Grammars compiled (cache misses), by process",
                                       labels=["model_name", "process"])
        for process in sorted(s.grammar_cache_bytes):
            grammar_bytes.add_metric([self.model_name, process], s.grammar_cache_bytes[process])
            compiles.add_metric([self.model_name, process], s.grammar_compiles.get(process, 0))
        yield grammar_bytes
        yield compiles
        yield _histogram("v4serve_kv_store_read_seconds", "Per-request SSD store load time", name, s.store_read_seconds)
        phases = HistogramMetricFamily("v4serve_kv_store_load_phase_seconds", "Where each SSD store load's time went: "
                                       "queue (for a reader thread), read and verify (file reads and checksums; "
                                       "the snapshot's beside the blocks' add up), stack (host tensors), wait "
                                       "(for the engine thread), install (the copy to the device)",
                                       labels=["model_name", "phase"])
        for phase in LOAD_PHASES:
            h = s.store_load_phases.get(phase, EMPTY_READS)
            phases.add_metric([self.model_name, phase], _buckets(h), h.total)
        yield phases
        yield from self._kv_transfer(s)
        yield from self._vllm_names(s)

    def _kv_transfer(self, s: EngineStats) -> Iterator[Metric]:
        """Prefill and decode apart: hand-overs made (prefill side), fetched (decode side), and fetches that
        fell short (what was missing was computed on the decode replica)."""
        name = [self.model_name]
        handovers = CounterMetricFamily("v4serve_kv_transfer_handovers", "Prompts whose KV a prefill replica handed "
                                        "over for a decode replica (failed: no store room)",
                                        labels=["model_name", "outcome"])
        handovers.add_metric([*name, "ok"], s.handovers)
        handovers.add_metric([*name, "failed"], s.handover_failures)
        yield handovers
        fetches = CounterMetricFamily("v4serve_kv_transfer_requests", "Hand-overs a decode replica fetched, by "
                                      "where from (the network, or a store it shares with the prefill replica)",
                                      labels=["model_name", "source"])
        fetches.add_metric([*name, "network"], s.fetches - s.fetches_local)
        fetches.add_metric([*name, "shared_store"], s.fetches_local)
        yield fetches
        received = CounterMetricFamily("v4serve_kv_transfer_received_bytes", "Store-file bytes a decode replica "
                                       "brought in from hand-overs", labels=["model_name"])
        received.add_metric(name, s.fetched_bytes)
        yield received
        fallbacks = CounterMetricFamily("v4serve_kv_transfer_fallbacks", "Hand-over fetches that fell short, by "
                                        "reason: the decode replica computed what was missing",
                                        labels=["model_name", "reason"])
        for reason in sorted(set(FALLBACK_REASONS) | set(s.fetch_fallbacks)):
            fallbacks.add_metric([*name, reason], s.fetch_fallbacks.get(reason, 0))
        yield fallbacks
        yield _histogram("v4serve_kv_transfer_fetch_seconds", "Per-request hand-over fetch time (decode side)", name,
                         s.fetch_seconds)

    def _vllm_names(self, s: EngineStats) -> Iterator[Metric]:
        labels = ["model_name", "engine"]
        for metric, doc, kind, value in _VLLM_NAMES:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(metric, doc, labels=labels)
            family.add_metric([self.model_name, "0"], value(s))
            yield family
        # Info-style gauges (value 1) whose labels carry the facts: an endpoint picker reads the block
        # size from the first, and from the second that no LoRA adapter is loaded or asked for.
        config = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration", labels=list(self.cache_info))
        config.add_metric(list(self.cache_info.values()), 1.0)
        yield config
        lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters running and waiting (none: v4serve "
                                 "serves no adapters)", labels=["max_lora", "running_lora_adapters",
                                                                "waiting_lora_adapters"])
        lora.add_metric(["0", "", ""], 1.0)
        yield lora


def _histogram(metric: str, doc: str, labels: list[str], h: HistogramSnapshot) -> HistogramMetricFamily:
    family = HistogramMetricFamily(metric, doc, labels=["model_name"])
    family.add_metric(labels, _buckets(h), h.total)
    return family


def _buckets(h: HistogramSnapshot) -> list[tuple[str, int]]:
    cumulative, buckets = 0, []
    for bound, count in zip((*h.buckets, float("inf")), h.counts, strict=True):
        cumulative += count
        buckets.append((floatToGoString(bound), cumulative))
    return buckets


class HealthCollector:
    """`v4serve_engine_healthy`: 1 while the engine takes requests, 0 once it has stopped or is
    shutting down (what /health answers), read at scrape time. A dead engine leaves /metrics
    answering, so `up` alone would not tell."""

    def __init__(self, model_name: str, healthy: Callable[[], bool]) -> None:
        self.model_name, self.healthy = model_name, healthy

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("v4serve_engine_healthy", "1 while the engine takes requests (/health 200), else 0",
                                   labels=["model_name"])
        family.add_metric([self.model_name], 1.0 if self.healthy() else 0.0)
        yield family


# What `v4serve_requests_limited_total{limit=...}` counts: requests a bound refused or ended.
LIMITS = ("unread_held",  # half of --max-unread-tokens unread: the engine holds the stream's requests
          "unread_output",  # a stream ended: --max-unread-tokens unread, or held past --unread-timeout
          "logprob_entries",  # --max-logprob-entries: refused up front or ended
          "request_tokens",  # --max-request-tokens: prompts + n × max_tokens over the ceiling (400)
          "media_type",  # a body not sent as application/json (415)
          "origin",  # a POST from another site's page (403)
          "requests_at_once",  # --max-connections requests already running (503)
          "preprocess_cpu",  # --max-preprocess-seconds of CPU time to prepare (400)
          "body_containers")  # more JSON objects and arrays than a body may hold (400)


def use_multiprocess_values(folder: str) -> None:
    """Metric values made from now on, in this process and in those it starts, live in files under
    `folder` (prometheus_client reads the variable when imported, and each value's file when made)."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    values.ValueClass = values.get_value_class()


class TokenTally:
    """Each token's count and each gap between tokens, gathered on the event loop and added to their
    series once per pass of the loop (one engine step's outputs arrive in one pass) instead of once
    per token: prometheus_client's `inc` and `observe` take a lock and 4-6 calls each, the front end's
    largest cost per streamed token after the text. A scrape adds what is pending first (`flush`), so
    it never reads less than a per-token count would give."""

    def __init__(self, gaps: Any) -> None:
        """`gaps`: the inter-token latency histogram's series."""
        self._gaps = gaps
        # prometheus_client has kept a histogram series as one count per bucket (`_buckets`, by the upper
        # bounds in `_upper_bounds`) and a `_sum` since 0.4 (tests/test_metrics.py checks a tally against
        # `observe`); were that to change, each gap is observed at once.
        bucketed = len(getattr(gaps, "_buckets", ())) == len(getattr(gaps, "_upper_bounds", [None])) and hasattr(
            gaps, "_sum")
        self._bounds: list[float] | None = list(gaps._upper_bounds) if bucketed else None
        self._counts = [0] * len(self._bounds or ())
        self._gap_sum = 0.0
        self._tokens: dict[Any, int] = {}  # counter series → tokens not yet added
        self._flush_queued = False

    def add(self, series: Any, count: int, gap: float | None) -> None:
        """`count` tokens for `series`; `gap`: seconds since the choice's last token (None: its first)."""
        self._tokens[series] = self._tokens.get(series, 0) + count
        if gap is not None:
            if self._bounds is None:
                self._gaps.observe(gap)
            else:
                self._counts[bisect_left(self._bounds, gap)] += 1
                self._gap_sum += gap
        if not self._flush_queued:
            self._flush_queued = True
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # not on an event loop: nothing to gather for
                self.flush()

    def flush(self) -> None:
        self._flush_queued = False
        tokens, self._tokens = self._tokens, {}
        for series, count in tokens.items():
            series.inc(count)
        if self._gap_sum or any(self._counts):
            for i, count in enumerate(self._counts):
                if count:
                    self._gaps._buckets[i].inc(count)  # noqa: SLF001 - see __init__
                    self._counts[i] = 0
            self._gaps._sum.inc(self._gap_sum)  # noqa: SLF001
            self._gap_sum = 0.0


class Metrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats], store_capacity_bytes: int = 0,
                 healthy: Callable[[], bool] = lambda: True, cache_info: Mapping[str, object] | None = None,
                 tenants: Iterable[str] = (), multiprocess_dir: str | None = None) -> None:
        """`multiprocess_dir`: the folder the API-server processes' values share (`use_multiprocess_values`
        made the values of this process live there)."""
        self.registry = CollectorRegistry()  # what /metrics renders
        r = self.registry
        if multiprocess_dir is not None:
            multiprocess.MultiProcessCollector(self.registry, path=multiprocess_dir)
            r = CollectorRegistry()  # the metrics below register here, unrendered: the files hold their values
        self.registry.register(EngineCollector(model_name, stats, cache_info))
        self.registry.register(HealthCollector(model_name, healthy))
        label = ["model_name"]
        # The store's size bound (0 when off), so a dashboard or alert can show usage as a fraction.
        Gauge("v4serve_kv_store_capacity_bytes", "Size bound of the SSD prefix store (--kv-store-max-bytes; 0: off)",
              label, registry=r, multiprocess_mode="max").labels(model_name=model_name).set(store_capacity_bytes)
        self.label = {"model_name": model_name}
        # Request counters carry the tenant (a name from --api-keys-file, "default" otherwise: bounded by
        # the file); the per-token histograms do not.
        tenant = [*label, "tenant"]
        self.prompt_tokens = Counter("v4serve_prompt_tokens", "Prompt tokens of finished requests", tenant, registry=r)
        self.generation_tokens = Counter("v4serve_generation_tokens", "Generated tokens", tenant, registry=r)
        self.finished = Counter("v4serve_request_success", "Finished requests", [*tenant, "finished_reason"],
                                registry=r)
        self.ttft = Histogram("v4serve_time_to_first_token_seconds", "Time to first token", label,
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("v4serve_inter_token_latency_seconds", "Time between output tokens", label,
                             buckets=_ITL, registry=r)
        self.e2e = Histogram("v4serve_e2e_request_latency_seconds", "Arrival to finish", label,
                             buckets=_LATENCY, registry=r)
        # Every series exists from the start (at 0), so dashboards and rate() see it before the
        # first event.
        # Each token observes these: the labelled series are looked up once, not per token.
        self.ttft_series, self.itl_series, self.e2e_series = (m.labels(**self.label) for m in (self.ttft, self.itl,
                                                                                               self.e2e))
        self.tally = TokenTally(self.itl_series)
        self._generated: dict[str, Any] = {}  # per tenant, its generation_tokens series
        for name in sorted({DEFAULT_TENANT, *tenants}):
            self.add_tenant(name)
        self.limited = Counter("v4serve_requests_limited", "Requests refused or ended by a server limit",
                               [*label, "limit"], registry=r)
        for limit in LIMITS:
            self.limited.labels(**self.label, limit=limit)
        self.closed = Counter("v4serve_connections_closed", "Connections the daemon closed before a request came "
                              "(header_timeout: idle, or headers too slow; idle_evicted: the longest idle, to make "
                              "room past --max-connections; header_size: headers past their bounds, answered 431)",
                              [*label, "reason"], registry=r)
        for reason in ("header_timeout", "idle_evicted", "header_size"):
            self.closed.labels(**self.label, reason=reason)
        # A prefill replica's side of hand-overs: what its HTTP server sent decode replicas.
        self.sent_bytes = Counter("v4serve_kv_transfer_sent_bytes", "Store-file bytes a prefill replica sent decode "
                                  "replicas over HTTP", label, registry=r).labels(**self.label)
        self.sent = Counter("v4serve_kv_transfer_sent_requests", "Hand-overs a prefill replica sent over HTTP",
                            label, registry=r).labels(**self.label)

    def add_tenant(self, tenant: str) -> None:
        self.prompt_tokens.labels(**self.label, tenant=tenant)
        self._generated[tenant] = self.generation_tokens.labels(**self.label, tenant=tenant)
        for reason in FINISH_REASONS:
            self.finished.labels(**self.label, tenant=tenant, finished_reason=reason)

    def count_closed(self, reason: str) -> None:
        self.closed.labels(**self.label, reason=reason).inc()

    def count_limited(self, limit: str) -> None:
        self.limited.labels(**self.label, limit=limit).inc()

    def generated(self, tenant: str) -> Any:
        """The tenant's generation_tokens series."""
        series = self._generated.get(tenant)
        if series is None:
            series = self._generated[tenant] = self.generation_tokens.labels(**self.label, tenant=tenant)
        return series

    def track(self, requests: list[Request], tenant: str = DEFAULT_TENANT) -> RequestTracker:
        return RequestTracker(self, requests, tenant)


class RequestTracker:
    """The front end's view of one prompt's choices: first token, gaps between tokens, finish."""

    def __init__(self, metrics: Metrics, requests: list[Request], tenant: str = DEFAULT_TENANT) -> None:
        self.metrics, self.requests, self.tenant = metrics, requests, tenant
        self.last_token: list[float | None] = [None] * len(requests)
        self._generated = metrics.generated(tenant)
        self._tally = metrics.tally

    def tokens(self, index: int, count: int, now: float | None = None) -> None:
        if not count:
            return
        now = time.monotonic() if now is None else now
        last = self.last_token[index]
        self._tally.add(self._generated, count, None if last is None else now - last)
        if last is None:
            self.metrics.ttft_series.observe(now - self.requests[index].arrival_time)
        self.last_token[index] = now

    def finish(self, index: int, reason: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        m, lb, request = self.metrics, self.metrics.label, self.requests[index]
        m.e2e_series.observe(now - request.arrival_time)
        m.prompt_tokens.labels(**lb, tenant=self.tenant).inc(request.num_prompt_tokens)
        m.finished.labels(**lb, tenant=self.tenant, finished_reason=reason).inc()
