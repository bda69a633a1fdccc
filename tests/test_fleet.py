"""Three replicas behind the pinned routers (bench/bench_fleet.py's fleets, the tiny model on loopback)
serve 8 documents × 10 questions in a seeded random order: with cache-aware routing (both routers'
`cache_aware`, and vllm-router's `kv_aware` fed by the replicas' KV events) the fleet's
prefix hit rate (from the replicas' /metrics) is at least 0.9 of one replica's, and round robin's is
clearly below it. Every fleet reuses the same three daemons, their prefix caches emptied in between.
The figures go to bench/results/fleet_test.json."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.bench_fleet import BLOCK, FLEETS, FleetRun, Job, measure, measure_placed, replicas, report, workload

DOCS, QUESTIONS, BLOCKS, REPLICAS = 8, 10, 5, 3
JOBS = workload(DOCS, QUESTIONS, BLOCKS)


def concurrency(policy: str) -> int:
    """Cache-aware fleets get a request per replica in flight (never two of one document, so their hit
    rates do not depend on timing): one at a time, their routers would put every document on their
    first worker and the test would say nothing about routing. Round robin's placement depends on the
    order requests reach it, so it gets one at a time, where its arithmetic below is exact."""
    return 1 if policy == "round_robin" else REPLICAS


@pytest.fixture(scope="module")
def urls() -> Iterator[list[str]]:
    with replicas(REPLICAS) as started:
        yield started


@pytest.fixture(scope="module")
def runs(urls: list[str]) -> dict[str, FleetRun]:
    kv_aware = next(f for f in FLEETS if f.policy == "kv_aware")
    done = [measure(fleet, urls, JOBS, concurrency(fleet.policy)) for fleet in FLEETS if fleet is not kv_aware]
    done.append(measure_placed(kv_aware, urls, JOBS, BLOCKS))
    report(done, {"docs": DOCS, "questions": QUESTIONS, "replicas": REPLICAS, "blocks": BLOCKS, "seed": 0,
                  "requests": len(JOBS)}, name="fleet_test")
    return {run.name: run for run in done}


def test_one_replica_hits_every_documents_blocks_after_its_first_question(runs: dict[str, FleetRun]) -> None:
    # The reference the fleets are held to, checked against the workload's design: each document is
    # cold once, then each of its other questions hits exactly its BLOCKS blocks.
    alone = runs["one replica"]
    assert alone.spread == [DOCS * QUESTIONS]
    assert alone.hits == DOCS * (QUESTIONS - 1) * BLOCKS * BLOCK


@pytest.mark.parametrize("name", ["vllm-router cache_aware", "sglang-router cache_aware"])
def test_cache_aware_routing_keeps_one_replicas_hit_rate(runs: dict[str, FleetRun], name: str) -> None:
    """vllm-router's cache_aware routes on the token ids of each worker's /v1/completions/render,
    SGLang's on the request's text. (kv_aware weighs cached tokens against requests in flight, so with
    three in flight where its questions go depends on timing: its own test below sends one at a time.)"""
    fleet, alone = runs[name], runs["one replica"]
    assert sum(fleet.spread) == DOCS * QUESTIONS
    assert fleet.hit_rate >= 0.9 * alone.hit_rate, (fleet.spread, fleet.hit_rate, alone.hit_rate)


def replicas_reached(jobs: list[Job], start: int) -> dict[int, set[int]]:
    """Which replicas each document's requests reach when a rotation starting at `start` places them."""
    reached: dict[int, set[int]] = {}
    for i, job in enumerate(jobs):
        reached.setdefault(job.doc, set()).add((start + i) % REPLICAS)
    return reached


def test_round_robin_hits_clearly_less_than_cache_aware_routing(runs: dict[str, FleetRun]) -> None:
    # Sent one at a time, request i goes to replica (start + i) % 3, and in this seeded order every
    # document's 10 questions then reach all 3 replicas wherever the rotation starts (the router's
    # readiness probe may have moved it). So each document is cold 3 times instead of once: 7 of its
    # 10 requests hit instead of 9, each the same BLOCKS blocks, a hit rate of exactly 7/9 ≈ 0.78 of
    # one replica's, against the 0.9 cache-aware routing must keep. 0.8 sits between, above 7/9 by
    # more than float noise and below 0.9 by a clear 0.1.
    for start in range(REPLICAS):
        assert all(len(reached) == REPLICAS for reached in replicas_reached(JOBS, start).values())
    rotating, alone = runs["vllm-router round_robin"], runs["one replica"]
    assert sorted(rotating.spread) == [26, 27, 27]
    assert rotating.hit_rate <= 0.8 * alone.hit_rate, (rotating.hit_rate, alone.hit_rate)


def test_kv_aware_routing_follows_the_replicas_kv_events(runs: dict[str, FleetRun]) -> None:
    """Document d placed on replica d % 3 beforehand (its blocks announced in that replica's events),
    then every question sent through vllm-router's kv_aware one at a time: each goes where its document
    is, so every one hits its document's blocks. Without the events each would go to the router's
    least-loaded worker, its first: 80 requests on one replica, 5 of the 8 documents cold there once."""
    placed = runs["vllm-router kv_aware (documents placed)"]
    per_replica = [QUESTIONS * len(range(r, DOCS, REPLICAS)) for r in range(REPLICAS)]  # 30, 30, 20
    assert placed.spread == per_replica, placed.spread
    # Each hit its document's blocks at least (a placed document's prompt-end state can take a hit
    # a little further into the question).
    assert placed.hits >= DOCS * QUESTIONS * BLOCKS * BLOCK, placed.hits
