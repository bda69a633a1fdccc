"""A bounded load test: many concurrent clients, shared prefixes, streaming and not, a quarter of the
streams dropped mid-way. Counts what a production engine must get right under load: no 5xx, nothing
leaked afterwards, and every completed temperature-0 request equal to its solo output.

    .venv/bin/python bench/bench_load.py [--clients 48] [--requests 1000]

runs it against a fresh daemon and writes bench/results/bench_load.json. tests/test_load.py runs the
same load against an in-process server, where it also checks the cache's integrity.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402

DOCS = [f"Document {d}: " + " ".join(random.Random(d).choice(["alpha", "beta", "gamma", "delta", "kappa"])
                                      for _ in range(80)) for d in range(4)]
QUESTIONS = [f"\nQuestion {q}: what does part {q} say?" for q in range(6)]


@dataclass(frozen=True)
class Job:
    chat: bool
    doc: int
    question: int

    @property
    def max_tokens(self) -> int:
        return 4 + 4 * (self.question % 3)

    def body(self, stream: bool) -> dict[str, Any]:
        common = {"max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
        if self.chat:
            return {**common, "messages": [{"role": "system", "content": DOCS[self.doc]},
                                           {"role": "user", "content": QUESTIONS[self.question]}]}
        return {**common, "prompt": DOCS[self.doc] + QUESTIONS[self.question]}

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


ALL_JOBS = [Job(chat, d, q) for chat in (False, True) for d in range(len(DOCS)) for q in range(len(QUESTIONS))]


@dataclass
class LoadResult:
    clients: int
    sent: int = 0
    completed: int = 0
    aborted: int = 0  # dropped by the client mid-stream, on purpose
    failed: int = 0  # anything but a complete 200 (includes the 5xx)
    status_5xx: int = 0
    mismatched: int = 0  # completed, but not the solo output
    leaked: dict[str, float] = field(default_factory=dict)  # non-zero gauges once all is done
    seconds: float = 0.0


def _text(job: Job, reply: dict[str, Any]) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if job.chat else choice["text"]


async def _stream(client: httpx.AsyncClient, job: Job, drop_after: int | None) -> tuple[str, bool]:
    """(text, whether it completed with [DONE] and no error); stops reading after `drop_after` events."""
    text, events = "", 0
    async with client.stream("POST", job.path, json=job.body(stream=True)) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise httpx.HTTPStatusError("refused", request=resp.request, response=resp)
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text, True
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return text, False
            events += 1
            choice = chunk["choices"][0] if chunk["choices"] else {}
            text += (choice.get("delta") or {}).get("content") or "" if job.chat else choice.get("text") or ""
            if drop_after is not None and events >= drop_after:
                return text, False  # leaving the block closes the connection: a client disconnect
    return text, False


async def solo_outputs(url: str) -> dict[Job, str]:
    """Each job's output with nothing else running."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        out = {}
        for job in ALL_JOBS:
            resp = await client.post(job.path, json=job.body(stream=False))
            resp.raise_for_status()
            out[job] = _text(job, resp.json())
        return out


async def run_load(url: str, clients: int = 48, requests: int = 1000, seed: int = 0) -> tuple[LoadResult, dict]:
    """The load against a running daemon; → (figures, the solo outputs it compared against)."""
    solo = await solo_outputs(url)
    result, rng = LoadResult(clients=clients), random.Random(seed)
    plan = [(rng.choice(ALL_JOBS), rng.random()) for _ in range(requests)]
    queue: asyncio.Queue[tuple[Job, float]] = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            job, dice = queue.get_nowait()
            result.sent += 1
            try:
                if dice < 0.40:  # plain request
                    resp = await client.post(job.path, json=job.body(stream=False))
                    if resp.status_code >= 500:
                        result.status_5xx += 1
                    if resp.status_code != 200:
                        result.failed += 1
                        continue
                    text, complete = _text(job, resp.json()), True
                else:  # a stream, a quarter of all requests dropped after 1-3 events
                    drop = rng.randint(1, 3) if dice >= 0.75 else None
                    text, complete = await _stream(client, job, drop)
                    if drop is not None and not complete:
                        result.aborted += 1
                        continue
                    if not complete:
                        result.failed += 1
                        continue
            except httpx.HTTPStatusError as exc:
                result.failed += 1
                result.status_5xx += exc.response.status_code >= 500
                continue
            except httpx.HTTPError:
                result.failed += 1
                continue
            result.completed += 1
            result.mismatched += text != solo[job]

    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    result.seconds = time.perf_counter() - t0
    result.leaked = await settled_gauges(url)
    return result, solo


LEAK_GAUGES = ("v4serve_requests_running", "v4serve_requests_waiting", "v4serve_state_cache_usage",
               "v4serve_block_cache_usage")


async def settled_gauges(url: str, timeout: float = 30.0) -> dict[str, float]:
    """The gauges that must fall back to 0 once every request is over (aborts land asynchronously):
    those still above 0 after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while True:
            text = (await client.get("/metrics")).text
            values = {name: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() for name in LEAK_GAUGES
                      if line.startswith(name + "{")}
            leaked = {k: v for k, v in values.items() if v}
            if not leaked or time.monotonic() > deadline:
                return leaked
            await asyncio.sleep(0.2)


def report(result: LoadResult, name: str = "bench_load") -> Path:
    figures = asdict(result)
    rows = [[k, v if not isinstance(v, float) else round(v, 1)] for k, v in figures.items() if k != "leaked"]
    rows.append(["leaked", json.dumps(result.leaked) if result.leaked else "nothing"])
    print_table(f"load test: {result.clients} clients, shared prefixes, 60% streams (25% of all dropped mid-way)",
                ["figure", "value"], rows)
    return write_results(name, figures)


def main() -> None:
    from tests.daemon import daemon

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=48)
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    with daemon("--max-num-seqs", "16") as url:
        result, _ = asyncio.run(run_load(url, args.clients, args.requests))
    report(result)


if __name__ == "__main__":
    main()
