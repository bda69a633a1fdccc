"""The front end's per-token metrics, gathered per pass of the event loop (`TokenTally`): the same series
as one `inc` and one `observe` per token give."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from v4serve.engine.stats import EngineStats
from v4serve.server.metrics import _ITL, Metrics

# Bucket bounds exactly (a gap equal to a bound counts in that bound's bucket), either side of them, past
# the last, and zero.
GAPS = [0.0, 0.001, 0.0010001, 0.0009999, 0.0025, 0.02, 0.019, 2.56, 2.57, 100.0, 0.3, 0.001]


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples
            if s.name.startswith(name) and not s.name.endswith("_created")}


def test_tally_gives_what_one_observe_per_token_gives() -> None:
    metrics = Metrics("m", EngineStats)
    reference = CollectorRegistry()
    gaps = Histogram("v4serve_inter_token_latency_seconds", "", ["model_name"], buckets=_ITL,
                     registry=reference).labels(model_name="m")
    tokens = Counter("v4serve_generation_tokens", "", ["model_name", "tenant"],
                     registry=reference).labels(model_name="m", tenant="default")
    generated = metrics.generated("default")

    async def feed() -> None:
        for i, gap in enumerate(GAPS):
            metrics.tally.add(generated, 1 + i % 3, gap)
            gaps.observe(gap)
            tokens.inc(1 + i % 3)
            if i == 5:
                await asyncio.sleep(0)  # a pass of the loop ends: what was gathered so far is added
        metrics.tally.add(generated, 2, None)  # a choice's first token: counted, no gap
        tokens.inc(2)
        await asyncio.sleep(0)

    asyncio.run(feed())
    for name in ("v4serve_inter_token_latency_seconds", "v4serve_generation_tokens"):
        got, want = _samples(metrics.registry, name), _samples(reference, name)
        assert want and got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-12, abs=0), key  # a sum adds in another order


def test_a_scrape_reads_what_this_pass_of_the_loop_gathered() -> None:
    metrics = Metrics("m", EngineStats)

    async def scrape_at_once() -> dict[tuple, float]:
        metrics.tally.add(metrics.generated("default"), 5, 0.5)
        metrics.tally.flush()  # what /metrics does before it renders
        return _samples(metrics.registry, "v4serve_")

    got = asyncio.run(scrape_at_once())
    assert got[("v4serve_generation_tokens_total", (("model_name", "m"), ("tenant", "default")))] == 5
    assert got[("v4serve_inter_token_latency_seconds_count", (("model_name", "m"),))] == 1


def test_every_store_error_kind_is_a_series_at_zero_from_the_start() -> None:
    """`v4serve_kv_store_errors_total{kind}` has every kind the store counts before any has happened (a
    rate or an alert over a series that appears only with its first error misses that error), a reader
    process that died included."""
    from v4serve.cache.ssd_file import ERROR_KINDS

    got = _samples(Metrics("m", EngineStats).registry, "v4serve_kv_store_errors_total")
    kinds = {dict(labels)["kind"]: value for (_, labels), value in got.items()}
    assert set(ERROR_KINDS) >= {"truncated", "checksum", "namespace", "collision", "format", "unreadable", "timeout",
                                "enospc", "write", "reader"}
    assert kinds == dict.fromkeys(ERROR_KINDS, 0.0)
