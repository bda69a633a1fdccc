"""The engine's numbers as an immutable snapshot, built on the engine thread after every step (and
after every batch of commands). Other threads — `/metrics`, `/health`, admission control — read the
latest snapshot and never the scheduler, the cache or the SSD store themselves."""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

# Seconds, for per-request SSD store loads.
STORE_READ_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


@dataclass(frozen=True)
class HistogramSnapshot:
    buckets: tuple[float, ...]  # upper bounds, ascending (+Inf implied)
    counts: tuple[int, ...]  # observations per bucket, the last one for +Inf (not cumulative)
    total: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass
class Histogram:
    """A plain-Python histogram the engine thread observes into; snapshots travel to readers."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    @classmethod
    def for_store_reads(cls) -> Histogram:
        return cls(STORE_READ_BUCKETS)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.buckets, tuple(self.counts), self.total)


@dataclass(frozen=True)
class EngineStats:
    # scheduler queues
    running: int = 0
    waiting: int = 0  # waiting for admission, including requests whose prefix is being read from disk
    fetching: int = 0  # waiting for their hand-over to be fetched from a prefill replica (not in `waiting`)
    # cache usage, fractions 0..1
    state_cache_usage: float = 0.0
    block_cache_usage: float = 0.0
    # cumulative counters
    prefix_queries: int = 0  # prompt tokens looked up
    prefix_hits_device: int = 0  # prompt tokens whose entries came from device memory
    prefix_hits_disk: int = 0  # prompt tokens whose entries were read from the SSD store
    recomputed_tokens: int = 0  # tokens recomputed to rebuild window state after hits
    preemptions: int = 0
    evictions: int = 0  # cached blocks evicted to make room
    # admissions with a hit, by how the window state was restored: block, snapshot, response_end, recompute
    restores: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # window-state snapshots: bytes taken into host memory and written to the SSD store; admissions by
    # how they wrote them (full, periodic, zero; auto resolved per prefix); prefix nodes hot now (auto)
    snapshot_bytes_host: int = 0
    snapshot_bytes_disk: int = 0
    write_modes: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    hot_prefixes: int = 0
    # the SSD store (zeros when it is off)
    store_read_bytes: int = 0
    store_written_bytes: int = 0
    store_usage_bytes: int = 0
    store_quarantine_files: int = 0  # bad files kept aside for inspection (bounded)
    store_errors: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    store_read_seconds: HistogramSnapshot = field(
        default_factory=lambda: Histogram.for_store_reads().snapshot())
    # each store load's seconds by phase (cache/ssd_loader.LOAD_PHASES)
    store_load_phases: Mapping[str, HistogramSnapshot] = field(default_factory=lambda: MappingProxyType({}))
    # prefill and decode apart (zeros when neither role): see scheduler.SchedulerStats
    handovers: int = 0
    handover_failures: int = 0
    fetches: int = 0
    fetched_files: int = 0
    fetched_bytes: int = 0
    fetches_local: int = 0
    fetch_fallbacks: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    fetch_seconds: HistogramSnapshot = field(default_factory=lambda: Histogram.for_store_reads().snapshot())
    # speculative decoding (zeros when it is off)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # compiled grammars, by the process that keeps them ("engine", and "front_end" when the engine runs
    # in its own process): the text bytes of those kept (the cache's bound) and the compiles so far
    grammar_cache_bytes: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    grammar_compiles: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def with_grammars(self, process: str, cache_bytes: int, compiles: int) -> EngineStats:
        """This snapshot with one more process's grammar numbers."""
        return replace(self, grammar_cache_bytes=MappingProxyType({**self.grammar_cache_bytes, process: cache_bytes}),
                       grammar_compiles=MappingProxyType({**self.grammar_compiles, process: compiles}))
