"""A bounded load test (bench/bench_load.py's load): 48 concurrent clients, 500 requests over
shared prefixes, streaming and not, a quarter of all requests dropped mid-stream. No 5xx, nothing
leaked (queues empty, no slot or block in use, the cache's integrity check passes), and every
completed temperature-0 request equal to its solo output. Its figures go to
bench/results/load_test.json."""

from __future__ import annotations

import asyncio
import json

from bench.bench_load import report, run_load, settled_gauges
from tests.daemon import PATIENCE, in_process_server
from v4serve.server.serve import ServeConfig


def test_load_with_disconnects_leaks_nothing_and_changes_no_output(tmp_path) -> None:
    cfg = ServeConfig(kv_store_dir=str(tmp_path), max_num_seqs=16)
    with in_process_server(cfg) as (url, engine):
        result, solo = asyncio.run(run_load(url, clients=48, requests=500))
        if result.leaked:  # run_load waits 30 s for the aborts to land; a busy machine may need longer
            result.leaked = asyncio.run(settled_gauges(url, timeout=PATIENCE))
        # Checked in the engine process, between steps: refcounts equal the (empty) block tables.
        integrity = asyncio.run(engine.command("check_cache_integrity"))
    path = report(result, "load_test")
    assert json.loads(path.read_text())["sent"] == 500
    assert integrity is None
    assert result.sent == 500 and result.status_5xx == 0 and result.failed == 0
    assert 75 <= result.aborted <= 175 and result.completed + result.aborted == result.sent
    assert result.mismatched == 0 and not result.leaked
    assert len(set(solo.values())) > 1  # the comparison is not between identical strings


def test_the_hostile_load_bench_runs_and_every_hostile_request_gets_its_4xx(tmp_path) -> None:
    """bench/bench_load.py --hostile at a smoke size: the probe runs in every phase and each hostile
    request is answered with its 4xx, never a 5xx."""
    from bench.bench_load import hostile_requests, run_hostile

    cfg = ServeConfig(no_kv_store=True, max_num_seqs=8)
    with in_process_server(cfg) as (url, _):
        figures = asyncio.run(run_hostile(url, clients=2, requests=12, idle=8, slow=4, quiet_seconds=0.5, rounds=1))
    assert set(figures["phases"]) == {"quiet", "hostile", "load", "load + hostile"}
    assert all(p["probes"] >= 1 and p["greedy_p50_s"] > 0 for p in figures["phases"].values())
    want = {"text/plain body": 415, "another site's page": 403}
    assert set(figures["hostile_statuses"]) == {name for name, _, _, _ in hostile_requests()}
    for name, counts in figures["hostile_statuses"].items():
        assert set(counts) == {want.get(name, 400)}, (name, counts)
