"""A bounded load test: many concurrent clients, shared prefixes, streaming and not, a quarter of the
streams dropped mid-way. Counts what a production engine must get right under load: no 5xx, nothing
leaked afterwards, and every completed temperature-0 request equal to its solo output.

    .venv/bin/python bench/bench_load.py [--clients 48] [--requests 1000] [--hostile]

runs it against a fresh daemon and writes bench/results/bench_load.json. With --hostile it then
probes a greedy request quietly, beside the load, and beside the load plus hostile clients
(requests meant to cost or break, idle and slow-header connections) and writes
bench/results/bench_load_hostile.json, then runs the prefill/decode cases (hostile peers beside an
innocent client on a decode replica; `--pd-only` runs just those) into bench/results/
bench_load_pd_hostile.json. tests/test_load.py runs the same load against an in-process server, where
it also checks the cache's integrity.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
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


async def run_load(url: str, clients: int = 48, requests: int = 1000, seed: int = 0,
                   solo: dict[Job, str] | None = None) -> tuple[LoadResult, dict]:
    """The load against a running daemon; → (figures, the solo outputs it compared against: `solo`, or
    each job run alone first)."""
    solo = solo if solo is not None else await solo_outputs(url)
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


# ---- hostile clients beside the load ------------------------------------------------------------------------------
GREEDY = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
NOT_JSON = {"Content-Type": "text/plain"}


def hostile_requests() -> list[tuple[str, str, dict[str, Any], dict[str, str]]]:
    """(name, path, body, headers) of requests that are small on the wire but meant to cost or break:
    each must get a 4xx and cost the others nothing."""
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    return [
        ("stop_token_ids x 200k", "/v1/completions", {**GREEDY, "stop_token_ids": [300] * 200_000, "n": 16}, {}),
        ("prompt = 300k empty strings", "/v1/completions", {**GREEDY, "prompt": [""] * 300_000}, {}),
        ("logit_bias key '²'", "/v1/completions", {**GREEDY, "logit_bias": {"²": 5}}, {}),
        ("schema with no finite value", "/v1/chat/completions",
         {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": endless}}}, {}),
        ("echo + logprobs 20 x n 16", "/v1/completions",
         {**GREEDY, "prompt": [65 + i % 90 for i in range(4000)], "echo": True, "logprobs": 20, "n": 16}, {}),
        ("4 prompts x n 16, no max_tokens", "/v1/completions", {**GREEDY, "prompt": ["a"] * 4, "n": 16,
                                                                "max_tokens": None}, {}),
        ("text/plain body", "/v1/completions", GREEDY, NOT_JSON),
        ("another site's page", "/reset_prefix_cache", {}, {"Origin": "https://evil.example"}),
    ]


async def hostile_loop(url: str, stop: asyncio.Event, statuses: dict[str, dict[int, int]],
                       rounds: int | None = None) -> None:
    """Send the hostile requests round and round until `stop` (or for `rounds`), counting each one's answers."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        done = 0
        while not stop.is_set() and (rounds is None or done < rounds):
            done += 1
            for name, path, body, headers in hostile_requests():
                if headers.get("Content-Type") == "text/plain":
                    resp = await client.post(path, content=json.dumps(body), headers=headers)
                else:
                    resp = await client.post(path, json=body, headers=headers)
                counts = statuses.setdefault(name, {})
                counts[resp.status_code] = counts.get(resp.status_code, 0) + 1


async def hold_connections(url: str, stop: asyncio.Event, idle: int = 200, slow: int = 50) -> None:
    """Idle connections, and ones that send their headers a line at a time, reopened as the server
    closes them (--header-timeout), until `stop`."""
    host, port = httpx.URL(url).host, httpx.URL(url).port

    async def one(slow_headers: bool) -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, port)
                if slow_headers:
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                while not stop.is_set() and not reader.at_eof():
                    if slow_headers:
                        writer.write(b"X-Slow: 1\r\n")
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(reader.read(1), 0.5)
                writer.close()
            except OSError:
                await asyncio.sleep(0.5)

    await asyncio.gather(*(one(i < slow) for i in range(idle + slow)))


async def probe(url: str, stop: asyncio.Event, seconds: list[float], health: list[float]) -> None:
    """A greedy 4-token request and a /health check, again and again until `stop`: their latencies."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            (await client.post("/v1/completions", json=GREEDY)).raise_for_status()
            seconds.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await client.get("/health")
            health.append(time.perf_counter() - t0)
            await asyncio.sleep(0.1)


async def probed(url: str, work: Any, quiet_seconds: float = 5.0) -> tuple[list[float], list[float]]:
    """Probe latencies while `work(stop)` runs (or for `quiet_seconds` when it is None)."""
    stop = asyncio.Event()
    seconds: list[float] = []
    health: list[float] = []
    prober = asyncio.ensure_future(probe(url, stop, seconds, health))
    if work is None:
        await asyncio.sleep(quiet_seconds)
    else:
        await work(stop)
    stop.set()
    await prober
    return seconds, health


async def run_hostile(url: str, clients: int, requests: int, idle: int = 200, slow: int = 50,
                      quiet_seconds: float = 5.0, rounds: int = 5) -> dict[str, Any]:
    """Four phases side by side: quiet, hostile clients alone (`rounds` of every hostile request, with
    the idle and slow-header connections), the load alone, the load with hostile clients beside it."""
    statuses: dict[str, dict[int, int]] = {}
    solo = await solo_outputs(url)  # once: the phases compare against the same outputs

    async def hostile(stop: asyncio.Event) -> None:
        side = asyncio.Event()
        held = asyncio.ensure_future(hold_connections(url, side, idle, slow))
        await hostile_loop(url, side, statuses, rounds)
        side.set()
        await held

    async def load(stop: asyncio.Event) -> None:
        await run_load(url, clients, requests, solo=solo)

    async def load_and_hostile(stop: asyncio.Event) -> None:
        side = asyncio.Event()
        extra = [asyncio.ensure_future(hostile_loop(url, side, statuses)),
                 asyncio.ensure_future(hold_connections(url, side, idle, slow))]
        await run_load(url, clients, requests, solo=solo)
        side.set()
        await asyncio.gather(*extra)

    phases = {"quiet": await probed(url, None, quiet_seconds), "hostile": await probed(url, hostile),
              "load": await probed(url, load),
              "load + hostile": await probed(url, load_and_hostile)}
    return {"phases": {name: {"greedy_p50_s": statistics.median(s), "greedy_max_s": max(s),
                              "health_max_s": max(h), "probes": len(s)} for name, (s, h) in phases.items()},
            "hostile_statuses": statuses}


# ---- one costly request at a time, beside an innocent client and a /health poller ------------------------------
def heavy_requests() -> list[tuple[str, str, dict[str, Any]]]:
    """(name, path, body): single requests of at most 4 MiB that cost the server the most to prepare
    (#41's cases); each must leave /health under 0.5 s and an innocent greedy request within 2x its
    quiet latency while it is processed."""
    props = {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(10_000)}
    big = {"type": "object", "properties": props}
    tool = {"type": "function", "function": {"name": "big", "parameters": big}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    mid = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2_000)}}
    blocks = [{"type": "text", "text": "a"}]
    return [
        ("chat, a 10,000-property tool, tool_choice none", "/v1/chat/completions",
         {**chat, "tools": [tool], "tool_choice": "none"}),
        ("chat, a 10,000-property tool, a missing named tool", "/v1/chat/completions",
         {**chat, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        ("responses, a 10,000-property tool", "/v1/responses",
         {"input": "hi", "max_output_tokens": 4, "tools": [{"type": "function", "name": "big", "parameters": big}]}),
        ("chat, a 2,000-property response_format (grammar compile)", "/v1/chat/completions",
         {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": mid}}}),
        ("chat render, 3.9 MB of text", "/v1/chat/completions/render",
         {"messages": [{"role": "user", "content": "a" * 3_900_000}]}),
        ("chat, 3.9 MB of JSON pasted as text", "/v1/chat/completions",
         {**chat, "messages": [{"role": "user", "content": '{"a": [1, 2]}, ' * 200_000}]}),
        ("count_tokens, 16,000 blocks", "/v1/messages/count_tokens",
         {"model": "v4serve-tiny", "messages": [{"role": "user", "content": blocks * 16_000}]}),
        ("count_tokens, 150,000 blocks", "/v1/messages/count_tokens",
         {"model": "v4serve-tiny", "messages": [{"role": "user", "content": blocks * 150_000}]}),
    ]


async def health_poller(url: str, stop: asyncio.Event, seconds: list[float]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            await client.get("/health")
            seconds.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)


async def innocent(url: str, stop: asyncio.Event, seconds: list[float]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            (await client.post("/v1/completions", json=GREEDY)).raise_for_status()
            seconds.append(time.perf_counter() - t0)
            await asyncio.sleep(0.05)


async def beside(url: str, work: Any) -> tuple[list[float], list[float], Any]:
    """(innocent latencies, /health latencies, what `work()` returned) while `work` runs."""
    stop = asyncio.Event()
    greedy: list[float] = []
    health: list[float] = []
    side = [asyncio.ensure_future(innocent(url, stop, greedy)), asyncio.ensure_future(health_poller(url, stop, health))]
    try:
        result = await work()
    finally:
        stop.set()
        await asyncio.gather(*side)
    return greedy, health, result


async def run_heavy(url: str, repeats: int = 3, quiet_seconds: float = 5.0) -> dict[str, Any]:
    """Each costly request `repeats` times in a row, the innocent client and the poller beside it; a
    quiet phase first for the innocent request's own latency."""

    async def quiet() -> None:
        await asyncio.sleep(quiet_seconds)

    greedy, health, _ = await beside(url, quiet)
    rows: dict[str, Any] = {"quiet": {"greedy_p50_s": statistics.median(greedy), "greedy_max_s": max(greedy),
                                      "health_max_s": max(health), "statuses": {}}}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for name, path, body in heavy_requests():
            body = {"model": "v4serve-tiny", **body}

            async def send(path: str = path, body: dict[str, Any] = body) -> tuple[dict[int, int], float]:
                statuses: dict[int, int] = {}
                t0 = time.perf_counter()
                for _ in range(repeats):
                    code = (await client.post(path, json=body)).status_code
                    statuses[code] = statuses.get(code, 0) + 1
                return statuses, (time.perf_counter() - t0) / repeats

            greedy, health, (statuses, each) = await beside(url, send)
            rows[name] = {"greedy_p50_s": statistics.median(greedy) if greedy else None,
                          "greedy_max_s": max(greedy) if greedy else None, "health_max_s": max(health),
                          "statuses": statuses, "request_s": each, "probes": len(greedy)}
    return rows


def report_heavy(rows: dict[str, Any]) -> Path:
    quiet = rows["quiet"]["greedy_p50_s"]
    table = []
    for name, r in rows.items():
        ratio = f"{r['greedy_max_s'] / quiet:.2f}" if r["greedy_max_s"] else "-"
        p50 = f"{r['greedy_p50_s'] / quiet:.2f}" if r["greedy_p50_s"] else "-"
        table.append([name, json.dumps(r["statuses"]), f"{r.get('request_s', 0):.2f}", p50, ratio,
                      f"{r['health_max_s'] * 1000:.0f}"])
    print_table("one costly request at a time: the innocent greedy request's latency (ratio to its quiet median) "
                "and /health's worst, while it is processed (goals: /health < 500 ms, greedy max < 2x)",
                ["request", "statuses", "s each", "greedy p50 ratio", "greedy max ratio", "/health max ms"], table)
    return write_results("bench_load_heavy", rows)


def report_hostile(figures: dict[str, Any]) -> Path:
    quiet = figures["phases"]["quiet"]["greedy_p50_s"]
    rows = [[name, f"{p['greedy_p50_s'] / quiet:.2f}", f"{p['greedy_max_s'] / quiet:.2f}",
             f"{p['health_max_s'] * 1000:.0f}", p["probes"]] for name, p in figures["phases"].items()]
    print_table("a greedy 4-token probe: quiet, beside hostile clients, beside the load, beside both "
                "(ratios to the quiet median)", ["phase", "p50 ratio", "max ratio", "/health max ms", "probes"], rows)
    print_table("hostile requests: answers", ["request", "statuses"],
                [[name, json.dumps(counts)] for name, counts in figures["hostile_statuses"].items()])
    return write_results("bench_load_hostile", figures)


# ---- prefill and decode apart: hostile peers beside an innocent client ----------------------------------------
PD_SECRET = {"V4SERVE_KV_PEER_SECRET": "bench-load-pd-peer-secret-0123456789"}
PD_DOC = "a document handed over from the prefill replica, block after block. " * 12
# Eight connections at once, each sending a 40 MB header line; prints each one's status.
HEADER_ATTACK = """
import contextlib, socket, sys, threading
request = b"GET /health HTTP/1.1\\r\\nHost: x\\r\\nX-Big: " + b"a" * (40 << 20) + b"\\r\\n\\r\\n"
statuses = []
def one():
    with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(request)
        statuses.append(sock.recv(64).split(b" ")[1].decode())
threads = [threading.Thread(target=one) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print(" ".join(statuses))
"""


def pd_body(prompt: str, **fields: Any) -> dict[str, Any]:
    return {"model": "v4serve-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}


async def prefill_leg(client: httpx.AsyncClient, producer: str, prompt: str) -> dict[str, Any]:
    reply = await client.post(producer + "/v1/completions",
                              json=pd_body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    reply.raise_for_status()
    return reply.json()["kv_transfer_params"]


async def run_pd_hostile(quiet_seconds: float = 5.0) -> dict[str, Any]:
    """A prefill and a decode replica (fetches given 3 s, --max-waiting 16) and two hostile producers the
    decode replica lists (one holding the fleet's secret, one not); each case runs while an innocent greedy
    client and a /health poller use the decode replica. Cases: a client naming its own server, zeroed KV
    from an impostor, another tenant's hand-over, an endless manifest, a negative size, sixteen manifests
    dripped a byte at a time, the files endpoint asked one name 20,000 times, eight 40 MB header lines."""
    import tempfile

    from tests.daemon import start_daemon
    from tests.hostile_peer import HostileProducer

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        producer = start_daemon("--kv-store-dir", str(root / "p"), "--kv-transfer-config",
                                '{"kv_role": "kv_producer"}', env=PD_SECRET)
        forger = HostileProducer(PD_SECRET["V4SERVE_KV_PEER_SECRET"].encode())
        impostor = HostileProducer(b"not-the-fleets-secret-0123456789")
        ports = [int(producer.url.rsplit(":", 1)[1]), forger.port, impostor.port]
        consumer = start_daemon("--kv-store-dir", str(root / "d"), "--max-waiting", "16", "--kv-transfer-config",
                                json.dumps({"kv_role": "kv_consumer", "kv_connector_extra_config": {
                                    "fetch_timeout": 3, "producers": [f"127.0.0.1:{p}" for p in ports]}}),
                                env=PD_SECRET)
        try:
            return await _pd_cases(producer.url, consumer.url, root / "p" / "handover", forger, impostor,
                                   quiet_seconds)
        finally:
            producer.stop()
            consumer.stop()
            forger.close()
            impostor.close()


async def _pd_cases(producer: str, consumer: str, handovers: Path, forger: Any, impostor: Any,
                    quiet_seconds: float, rounds: int = 8) -> dict[str, Any]:
    """Each case: `rounds` attacks made ready first (their prefill legs on the prefill replica, which is not
    what is measured), then sent one after another while the innocent client and the poller run."""
    from tests.hostile_peer import HandOver
    from v4serve.cache.kv_transfer import PATH
    from v4serve.cache.peer_auth import PEER_HEADER, request_proof

    secret = PD_SECRET["V4SERVE_KV_PEER_SECRET"].encode()
    client = httpx.AsyncClient(timeout=600)
    Attack = Any  # a zero-argument coroutine function returning the statuses it got

    async def decode_leg(prompt: str, params: dict[str, Any], **fields: Any) -> int:
        body = pd_body(prompt, kv_transfer_params=params, **fields)
        return (await client.post(consumer + "/v1/completions", json=body)).status_code

    async def handed_over(mode: str) -> tuple[str, dict[str, Any]]:
        prompt = PD_DOC + f"Q: {mode} {time.monotonic()}?"
        return prompt, await prefill_leg(client, producer, prompt)

    async def legs(mode: str, hostile: Any, count: int = 1) -> Attack:
        ready = []
        for _ in range(count):
            prompt, params = await handed_over(mode)
            hostile.handovers[params["remote_request_id"]] = HandOver(mode, handovers / params["remote_request_id"])
            ready.append((prompt, {**params, "remote_port": hostile.port}))
        return lambda: asyncio.gather(*(decode_leg(p, q) for p, q in ready))

    async def unlisted() -> Attack:
        prompt, params = await handed_over("unlisted")
        return lambda: asyncio.gather(decode_leg(prompt, {**params, "remote_port": 9}))

    async def another_tenant() -> Attack:  # a salt stands for the tenant: another root, the same prompt
        prompt, params = await handed_over("tenant")
        return lambda: asyncio.gather(decode_leg(prompt, params, cache_salt="another-tenant"))

    async def plain_prompt() -> Attack:  # what a fallback costs anyway: the same prompt, computed
        prompt = PD_DOC + f"Q: plain {time.monotonic()}?"
        return lambda: asyncio.gather(decode_leg(prompt, {}))

    async def repeated_names() -> Attack:
        _, params = await handed_over("names")
        target, files = PATH + params["remote_request_id"], PATH + params["remote_request_id"] + "/files"
        name = (await client.get(producer + target, headers={PEER_HEADER: request_proof(secret, "GET", target)[0]})
                ).json()["files"][0]["name"]
        body = json.dumps({"names": [name] * 20_000}).encode()

        async def send() -> list[int]:
            proof = {PEER_HEADER: request_proof(secret, "POST", files, body)[0]}
            return [(await client.post(producer + files, content=body, headers=proof)).status_code]
        return send

    async def huge_headers() -> Attack:
        host, port = httpx.URL(consumer).host, str(httpx.URL(consumer).port)

        async def send() -> list[int]:  # from a process of its own, as an attacker's bytes come from elsewhere
            attacker = await asyncio.create_subprocess_exec(sys.executable, "-c", HEADER_ATTACK, host, port,
                                                            stdout=asyncio.subprocess.PIPE)
            out, _ = await attacker.communicate()
            return [int(status) for status in out.split()]
        return send

    # (make one attack, how many, whether one made attack may be sent again: refused ones change nothing)
    cases_to_run = {
        "a plain prompt of the same length (what a fallback computes)": (plain_prompt, rounds, False),
        "unlisted producer (a client's own server)": (unlisted, 50 * rounds, True),
        "zeroed KV from an impostor": (lambda: legs("zeroed", impostor), rounds, False),
        "another tenant's hand-over": (another_tenant, rounds, False),
        "endless manifest": (lambda: legs("endless", forger), rounds, False),
        "negative size": (lambda: legs("negative_size", forger), rounds, False),
        "16 dripped manifests": (lambda: legs("drip", forger, 16), 1, False),
        "files: one name x 20,000": (repeated_names, 10 * rounds, True),
        "8 x a 40 MB header line": (huge_headers, rounds, True)}
    cases: dict[str, Any] = {}
    try:
        async def quiet() -> list[int]:
            await asyncio.sleep(quiet_seconds)
            return []
        greedy, health, _ = await beside(consumer, quiet)
        cases["quiet"] = {"greedy_p50_s": statistics.median(greedy), "greedy_max_s": max(greedy),
                          "health_max_s": max(health), "probes": len(greedy), "statuses": {}}
        for name, (make, n, again) in cases_to_run.items():
            attacks = [await make()] * n if again else [await make() for _ in range(n)]

            async def run(attacks: list[Attack] = attacks) -> list[int]:
                return [status for attack in attacks for status in await attack()]

            greedy, health, statuses = await beside(consumer, run)
            counts: dict[int, int] = {}
            for status in statuses:
                counts[status] = counts.get(status, 0) + 1
            cases[name] = {"greedy_p50_s": statistics.median(greedy), "greedy_max_s": max(greedy),
                           "health_max_s": max(health), "probes": len(greedy), "statuses": counts}
    finally:
        await client.aclose()
    return cases


def report_pd_hostile(cases: dict[str, Any]) -> Path:
    quiet = cases["quiet"]["greedy_p50_s"]
    rows = [[name, json.dumps(c["statuses"]), f"{c['greedy_p50_s'] / quiet:.2f}", f"{c['greedy_max_s'] / quiet:.2f}",
             f"{c['health_max_s'] * 1000:.0f}", c["probes"]] for name, c in cases.items()]
    print_table("prefill and decode apart, hostile peers: an innocent greedy request on the decode replica (ratio to "
                "its quiet median) and /health's worst while each case runs (goals: p50 <= 2x, /health < 500 ms)",
                ["case", "statuses", "p50 ratio", "max ratio", "/health max ms", "probes"], rows)
    return write_results("bench_load_pd_hostile", cases)


def main() -> None:
    from tests.daemon import daemon

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=48)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--hostile", action="store_true",
                        help="also run the load with hostile clients beside it, probing a greedy request")
    parser.add_argument("--heavy-only", action="store_true",
                        help="only the costly single requests beside an innocent client (--hostile runs them too)")
    parser.add_argument("--pd-only", action="store_true",
                        help="only the hostile prefill/decode peers beside an innocent client (--hostile runs "
                             "them too)")
    args = parser.parse_args()
    if args.pd_only:
        report_pd_hostile(asyncio.run(run_pd_hostile()))
        return
    with daemon("--max-num-seqs", "16") as url:
        if not args.heavy_only:
            result, _ = asyncio.run(run_load(url, args.clients, args.requests))
            report(result)
        if args.hostile or args.heavy_only:
            report_heavy(asyncio.run(run_heavy(url)))
        if args.hostile:
            report_hostile(asyncio.run(run_hostile(url, args.clients, args.requests)))
    if args.hostile:
        report_pd_hostile(asyncio.run(run_pd_hostile()))


if __name__ == "__main__":
    main()
