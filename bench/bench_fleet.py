"""The prefix-cache hit rate of a fleet: replicas behind a router against one replica alone.

A workload of documents × questions (each prompt a document several KV blocks long, then a short
question) is sent in a seeded random order to each fleet in turn, over the same replicas (the tiny
model on loopback): one replica alone, then every replica behind vLLM's and SGLang's routers
(`--policy cache_aware`, matching on each request's text or rendered tokens), behind vllm-router's
`--policy kv_aware` fed by the replicas' own KV events (`--kv-events-config`), and behind a router
that rotates (`--policy round_robin`). A fleet's hit
rate is the prompt tokens its replicas served from cache over those they looked up (their /metrics
before and after the workload). Cache-aware routing should keep each document on one replica, so the
fleet hits as one replica does; round robin makes a document cold on every replica it reaches.

    .venv/bin/python bench/bench_fleet.py [--docs 8] [--questions 10] [--replicas 3] [--blocks 5]
                                          [--concurrency 3] [--seed 0] [--quick]

prints the fleets side by side and writes bench/results/bench_fleet.json. tests/test_fleet.py runs
the same fleets and asserts on their hit rates.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from tests.daemon import PATIENCE, Daemon, start_daemon  # noqa: E402
from tests.routers import SGLANG_ROUTER, VLLM_ROUTER, router  # noqa: E402

MODEL = "v4serve-tiny"
# The tiny model's KV block: only whole blocks are cached, so a document spans several to be worth
# caching. Its tokenizer is byte-level (a BOS token, then one token per ASCII character), which is
# what lets a document be sized in characters here.
BLOCK = 128
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "kappa", "lambda", "sigma", "theta", "omega", "river",
         "stone", "cloud", "ember", "field", "harbor", "lantern", "meadow", "orchard", "summit")


@dataclass(frozen=True)
class Job:
    doc: int
    question: int
    prompt: str


def workload(docs: int, questions: int, blocks: int = 5, seed: int = 0) -> list[Job]:
    """Every (document, question) pair once, in a seeded random order. Each document fills `blocks`
    whole blocks and about a quarter of the next, which its question (about 60 characters) never
    completes: a warm request hits exactly the document's `blocks` blocks. Documents differ from their
    tenth character on, so no two share a block, while a router matching on text sees a question on
    a warm document as ~0.9 matched, far above the routers' threshold (0.3)."""
    rnd = random.Random(seed)
    texts = []
    for d in range(docs):
        text = f"Document {d}:"
        while len(text) < blocks * BLOCK + BLOCK // 4:
            text += " " + rnd.choice(WORDS)
        texts.append(text)
    jobs = [Job(d, q, f"{texts[d]}\nQuestion {q}: what does it say about {rnd.choice(WORDS)} and {rnd.choice(WORDS)}?")
            for d in range(docs) for q in range(questions)]
    rnd.shuffle(jobs)
    return jobs


def run_workload(url: str, jobs: Sequence[Job], concurrency: int = 1) -> list[float]:
    """Send the jobs in order, up to `concurrency` at once but never two of one document: a request
    then always finds its document's earlier requests finished, so whether it hits depends only on
    where it was routed, never on timing. → each request's seconds, which with one output token is
    its time to first token as a client sees it.

    Concurrency is what spreads the documents: both routers' cache-aware policies send a prompt no
    worker has seen to the least-loaded worker, ties to the first, so with one request at a time
    every document lands on one replica. A few in flight stay far below their load-balancing
    threshold (a difference of 64 requests), past which load would override cache affinity."""
    pending, busy, seconds = list(jobs), set[int](), list[float]()
    turn = threading.Condition()

    def take() -> Job | None:
        with turn:
            while pending:
                job = next((j for j in pending if j.doc not in busy), None)
                if job is not None:
                    pending.remove(job)
                    busy.add(job.doc)
                    return job
                turn.wait()
            return None

    def client() -> None:
        with httpx.Client(timeout=PATIENCE) as http:
            while (job := take()) is not None:
                t0 = time.perf_counter()
                try:
                    resp = http.post(url + "/v1/completions", json={"model": MODEL, "prompt": job.prompt,
                                                                    "max_tokens": 1, "temperature": 0})
                finally:  # even on an error, or the other clients would wait for this document forever
                    with turn:
                        seconds.append(time.perf_counter() - t0)
                        busy.discard(job.doc)
                        turn.notify_all()
                if resp.status_code != 200:
                    raise RuntimeError(f"{url}: {resp.status_code} {resp.text}")

    with ThreadPoolExecutor(concurrency) as pool:
        for done in [pool.submit(client) for _ in range(concurrency)]:
            done.result()
    return seconds


@dataclass(frozen=True)
class Counters:
    """A replica's cumulative numbers, from its /metrics."""
    queries: float  # prompt tokens looked up in the prefix cache
    hits: float  # of those, served from cache (device or disk)
    requests: float  # requests finished

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.queries - other.queries, self.hits - other.hits, self.requests - other.requests)


SAMPLE = re.compile(r"^(\w+)(?:\{[^}]*\})? (\S+)$")


def counters(url: str) -> Counters:
    totals = {"v4serve_prefix_cache_queries_total": 0.0, "v4serve_prefix_cache_hits_total": 0.0,
              "v4serve_request_success_total": 0.0}
    for line in httpx.get(url + "/metrics", timeout=PATIENCE).text.splitlines():
        found = SAMPLE.match(line)
        if found and found.group(1) in totals:  # summed over labels: hits by source, requests by finish reason
            totals[found.group(1)] += float(found.group(2))
    return Counters(*totals.values())


def reset_prefix_cache(url: str) -> None:
    resp = httpx.post(url + "/reset_prefix_cache", timeout=PATIENCE)
    if resp.status_code != 200:
        raise RuntimeError(f"{url}: {resp.status_code} {resp.text}")


def nothing(_: object) -> Sequence[str]:
    return ()


@dataclass(frozen=True)
class Fleet:
    """One way to serve the workload. Without a router command the first replica is sent the
    workload directly; otherwise the first `replicas` (None: all) sit behind the router. A kv_aware
    policy is one more: replica i publishing its KV events on its own endpoint (`replica_args`), the
    router told each worker's (`extra`)."""
    name: str
    command: Sequence[str] = ()  # the router's command line
    policy: str = "cache_aware"
    replicas: int | None = None
    # Flags replica i starts with. Every fleet's apply to every fleet, since they share the replicas.
    replica_args: Callable[[int], Sequence[str]] = field(default=nothing)
    # More router flags, given the worker URLs.
    extra: Callable[[Sequence[str]], Sequence[str]] = field(default=nothing)


# Each replica's KV-event endpoints, as it reports them once bound (a port the system picked: nothing
# else can have taken it): {worker URL: (events, replay)}.
EVENT_ENDPOINTS: dict[str, tuple[str, str]] = {}
PUBLISHING = re.compile(r"KV events: publishing on (\S+), replay on (\S+) ")


def publish_events(_: int) -> Sequence[str]:
    return ["--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                                              "replay_endpoint": "tcp://127.0.0.1:*"})]


def event_sources(workers: Sequence[str]) -> Sequence[str]:
    """vllm-router's static KV-event sources: each worker's events and replay endpoints, the block size
    its events carry, and the model they cache (one cache identity for the fleet)."""
    flags = ["--kv-event-block-size", str(BLOCK), "--kv-event-model", MODEL]
    for url in workers:
        events, replay = EVENT_ENDPOINTS[url]
        flags += ["--kv-event-source", f"{url}={events}", "--kv-event-replay-source", f"{url}={replay}"]
    return flags


FLEETS = [
    Fleet("one replica", replicas=1),
    Fleet("vllm-router cache_aware", VLLM_ROUTER),
    Fleet("sglang-router cache_aware", SGLANG_ROUTER),
    Fleet("vllm-router kv_aware", VLLM_ROUTER, "kv_aware", replica_args=publish_events, extra=event_sources),
    Fleet("vllm-router round_robin", VLLM_ROUTER, "round_robin"),
]


@dataclass(frozen=True)
class FleetRun:
    name: str
    concurrency: int
    replicas: list[Counters]  # each replica's counters over the workload
    seconds: list[float]  # each request's

    @property
    def hits(self) -> float:
        return sum(c.hits for c in self.replicas)

    @property
    def hit_rate(self) -> float:
        return self.hits / sum(c.queries for c in self.replicas)

    @property
    def spread(self) -> list[int]:
        return [round(c.requests) for c in self.replicas]


def measure(fleet: Fleet, urls: Sequence[str], jobs: Sequence[Job], concurrency: int = 1) -> FleetRun:
    """The workload through one fleet, counted on its replicas. Every replica's prefix cache is
    emptied first, so that each fleet starts cold and all can run the same workload."""
    workers = urls[:fleet.replicas]
    for url in urls:
        reset_prefix_cache(url)
    entry = (router(fleet.command, workers, fleet.policy, fleet.extra(workers)) if fleet.command
             else contextlib.nullcontext(workers[0]))
    with entry as url:  # counted from here on: a router's readiness probe is no part of the workload
        before = [counters(w) for w in workers]
        seconds = run_workload(url, jobs, concurrency)
        after = [counters(w) for w in workers]
    return FleetRun(fleet.name, concurrency, [a - b for a, b in zip(after, before, strict=True)], seconds)


def documents(jobs: Sequence[Job]) -> dict[int, str]:
    """Each document's text (a job's prompt up to its question)."""
    return {job.doc: job.prompt.rsplit("\nQuestion ", 1)[0] for job in jobs}


def published_blocks(url: str) -> int:
    """Blocks a replica has announced as stored on its device so far, from its replay socket (what
    the replay holds was sent live first, so a subscriber connected before has been sent it too)."""
    import msgspec
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(EVENT_ENDPOINTS[url][1])
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    stored = 0
    try:
        while True:
            if not sock.poll(int(PATIENCE * 1000)):
                raise RuntimeError(f"{url}: the KV-event replay did not answer")
            _, _, seq, payload = sock.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return stored
            events = msgspec.msgpack.decode(payload)[1]
            stored += sum(1 for e in events if e["type"] == "BlockStored" and e["medium"] == "GPU")
    finally:
        sock.close(linger=0)
        ctx.term()


def measure_placed(fleet: Fleet, urls: Sequence[str], jobs: Sequence[Job], blocks: int) -> FleetRun:
    """kv_aware's own question, without timing in it: with each document already on one replica
    (document d sent straight to replica d % n, its blocks announced in the replica's KV events), do
    the questions, sent one at a time through the router, go where their document is? Without events
    every question would go to the router's least-loaded (its first) worker."""
    for url in urls:
        reset_prefix_cache(url)
    with router(fleet.command, urls, fleet.policy, fleet.extra(urls)) as entry:
        announced = {url: published_blocks(url) for url in urls}
        with httpx.Client(timeout=PATIENCE) as http:
            for doc, text in sorted(documents(jobs).items()):
                url = urls[doc % len(urls)]
                resp = http.post(url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
                resp.raise_for_status()
                announced[url] += blocks
        for url, count in announced.items():  # every placed block announced before the first question
            deadline = time.monotonic() + PATIENCE
            while published_blocks(url) < count:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url}: the placed documents' blocks were never announced")
                time.sleep(0.05)
        before = [counters(w) for w in urls]
        seconds = run_workload(entry, jobs, 1)
        after = [counters(w) for w in urls]
    return FleetRun(fleet.name + " (documents placed)", 1, [a - b for a, b in zip(after, before, strict=True)],
                    seconds)


@contextlib.contextmanager
def replicas(n: int, fleets: Sequence[Fleet] = FLEETS) -> Iterator[list[str]]:
    """`n` daemons (the tiny model), started side by side with the flags `fleets` ask of each; their URLs."""
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(start_daemon, *(a for f in fleets for a in f.replica_args(i))) for i in range(n)]
    started: list[Daemon] = [f.result() for f in futures if f.exception() is None]
    try:
        failed = [error for f in futures if (error := f.exception()) is not None]
        if failed:
            raise failed[0]
        for d in started:
            found = PUBLISHING.search(Path(d.log.name).read_text(errors="replace"))
            if found:
                EVENT_ENDPOINTS[d.url] = (found.group(1), found.group(2))
        yield [d.url for d in started]
    finally:
        for d in started:
            d.stop()


def report(runs: Sequence[FleetRun], settings: dict[str, Any], name: str = "bench_fleet") -> Path:
    """The fleets side by side, each as a ratio to the first (one replica); their figures to a file."""
    alone = runs[0].hit_rate
    rows = [[r.name, r.hit_rate, r.hit_rate / alone, "/".join(map(str, r.spread)), r.concurrency,
             1000 * statistics.mean(r.seconds)] for r in runs]
    print_table(f"fleet prefix hit rate: {settings['docs']} documents × {settings['questions']} questions in random "
                "order, each fleet from cold caches",
                ["fleet", "hit rate", "/ one replica", "requests each", "at once", "mean TTFT ms"], rows)
    return write_results(name, {**settings, "fleets": [
        {"name": r.name, "hit_rate": r.hit_rate, "ratio_to_one_replica": r.hit_rate / alone,
         "concurrency": r.concurrency, "requests_per_replica": r.spread,
         "hits_per_replica": [c.hits for c in r.replicas], "queries_per_replica": [c.queries for c in r.replicas],
         "mean_ttft_s": statistics.mean(r.seconds), "p50_ttft_s": statistics.median(r.seconds)} for r in runs]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=5, help="KV blocks each document fills")
    parser.add_argument("--concurrency", type=int, default=3,
                        help="requests in flight at once, never two of one document (with 1, the cache-aware "
                             "routers put every document on their first worker)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4 documents × 5 questions of 3 blocks")
    args = parser.parse_args()
    if args.quick:
        args.docs, args.questions, args.blocks = 4, 5, 3
    jobs = workload(args.docs, args.questions, args.blocks, args.seed)
    with replicas(args.replicas) as urls:
        runs = [measure(fleet, urls, jobs, args.concurrency) for fleet in FLEETS]
        runs.append(measure_placed(next(f for f in FLEETS if f.policy == "kv_aware"), urls, jobs, args.blocks))
    report(runs, {"docs": args.docs, "questions": args.questions, "replicas": args.replicas, "blocks": args.blocks,
                  "seed": args.seed, "requests": len(jobs)})


if __name__ == "__main__":
    main()
