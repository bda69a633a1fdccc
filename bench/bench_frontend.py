"""CPU per streamed token on each side of the engine's IPC: the daemon (tiny model) serves N
concurrent streaming completions read to the end by clients in this process, and the CPU time of the
front end's processes (HTTP, detokenizing, SSE: one per API server, `--api-server-count`) and of the
engine process (the forward included: the tiny model runs on the CPU here; `bench/bench_host.py`
gives the engine's output path alone) is read from /proc before and after, divided by the tokens
streamed. Each API-server count gets a daemon of its own, measured one after the other in one run.

    python bench/bench_frontend.py [--streams 64 256] [--tokens 128] [--prompt 32] [--api-servers 1 2]
    python bench/bench_frontend.py --count-calls [--streams 64] [--tokens 128]

`--count-calls` counts instead of timing: the Python calls (and calls into C) the front end's
event-loop thread makes per streamed token, with the daemon's app under uvicorn on a thread of this
process (its engine in its own process). A count hardly moves with the machine's load, so it compares
two versions of the front end where this shared machine's CPU times cannot (±10 us per token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from tests.daemon import PATIENCE, in_process_server, start_daemon  # noqa: E402
from v4serve.server.serve import ServeConfig  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of one process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


def children(pid: int) -> dict[int, str]:
    """The processes `pid` started, with their kernel names."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out[int(entry.name)] = (entry / "comm").read_text().strip()
            except (OSError, ValueError):
                continue
    return out


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], tokens: int) -> int:
    body = {"model": "v4serve-tiny", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    made = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    made = usage["completion_tokens"]
    return made


async def load(url: str, streams: int, tokens: int, prompt: int) -> tuple[int, float]:
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=PATIENCE, limits=limits) as client:
        start = time.perf_counter()
        made = await asyncio.gather(*(stream(client, url, [70 + (i + j) % 200 for j in range(prompt)], tokens)
                                      for i in range(streams)))
        return sum(made), time.perf_counter() - start


def measure(url: str, pid: int, streams: int, tokens: int, prompt: int, api_servers: int) -> dict[str, Any]:
    asyncio.run(load(url, 2, 8, prompt))  # warm: connections, first compiles
    named = children(pid)
    fronts = [pid, *(p for p, name in named.items() if name == "v4serve-api")]
    (engine,) = (p for p, name in named.items() if name == "v4serve-engine")
    assert len(fronts) == api_servers, f"{len(fronts)} API-server processes running, {api_servers} asked for"
    procs = [*fronts, engine]
    before = {p: cpu_times(p) for p in procs}
    made, seconds = asyncio.run(load(url, streams, tokens, prompt))
    after = {p: cpu_times(p) for p in procs}
    spent = {p: sum(after[p]) - sum(before[p]) for p in procs}
    system = sum(after[p][1] - before[p][1] for p in fronts)  # the kernel's share: mostly a send() per chunk
    return {"api_servers": api_servers, "streams": streams, "tokens": made, "seconds": seconds,
            "tokens_per_s": made / seconds, "front_end_us_per_token": sum(spent[p] for p in fronts) / made * 1e6,
            "front_end_system_us_per_token": system / made * 1e6,
            "busiest_front_end_share": max(spent[p] for p in fronts) / sum(spent[p] for p in fronts),
            "engine_us_per_token": spent[engine] / made * 1e6}


def count_calls(streams: int, tokens: int, prompt: int) -> dict[str, Any]:
    """Calls per streamed token on the front end's event-loop thread (module-level function calls and
    calls into C, as `sys.setprofile` reports them)."""
    counts = {"call": 0, "c_call": 0}

    def profile(_frame: FrameType, event: str, _arg: Any) -> None:
        if event in counts:
            counts[event] += 1

    def on_loop(loop: asyncio.AbstractEventLoop, fn: Any) -> None:
        applied = threading.Event()
        loop.call_soon_threadsafe(lambda: (fn(), applied.set()))
        assert applied.wait(PATIENCE)

    cfg = ServeConfig(max_num_seqs=streams, max_model_len=1024, max_waiting=4 * streams, no_kv_store=True)
    with in_process_server(cfg) as (url, engine):
        loop = engine._loop  # noqa: SLF001 - the loop the app runs on
        asyncio.run(load(url, 2, 8, prompt))  # warm: connections, first compiles
        on_loop(loop, lambda: sys.setprofile(profile))
        made, _ = asyncio.run(load(url, streams, tokens, prompt))
        on_loop(loop, lambda: sys.setprofile(None))
    return {"streams": streams, "tokens": made, "calls_per_token": counts["call"] / made,
            "c_calls_per_token": counts["c_call"] / made}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--api-servers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--count-calls", action="store_true", help="count the front end's calls per token instead")
    args = parser.parse_args()
    if args.count_calls:
        counted = [count_calls(n, args.tokens, args.prompt) for n in args.streams]
        print_table(f"Front-end calls per streamed token (tiny model; {args.prompt}-token prompts, {args.tokens} "
                    "tokens a stream)", ["streams", "tokens", "Python calls per token", "calls into C per token"],
                    [[r["streams"], r["tokens"], r["calls_per_token"], r["c_calls_per_token"]] for r in counted])
        write_results("frontend_calls", {"tokens": args.tokens, "prompt": args.prompt, "rows": counted})
        return
    rows = []
    for count in args.api_servers:
        running = start_daemon("--max-num-seqs", str(max(args.streams)), "--max-model-len", "1024",
                               "--max-waiting", str(4 * max(args.streams)), "--api-server-count", str(count))
        try:
            if count > 1:  # the later API servers start once the first serves: wait until they have
                deadline = time.monotonic() + PATIENCE
                while sum(name == "v4serve-api" for name in children(running.proc.pid).values()) < count - 1:
                    assert time.monotonic() < deadline, "the API servers did not start"
                    time.sleep(0.1)
            rows += [measure(running.url, running.proc.pid, n, args.tokens, args.prompt, count) for n in args.streams]
        finally:
            running.stop()
    print_table(f"CPU per streamed token (tiny model; {args.prompt}-token prompts, {args.tokens} tokens a stream)",
                ["API servers", "streams", "tokens/s", "front end us/token (all API servers)", "of which in the kernel",
                 "busiest API server's share", "engine us/token (forward included)"],
                [[r["api_servers"], r["streams"], r["tokens_per_s"], r["front_end_us_per_token"],
                  r["front_end_system_us_per_token"], r["busiest_front_end_share"], r["engine_us_per_token"]]
                 for r in rows])
    write_results("frontend", {"tokens": args.tokens, "prompt": args.prompt, "rows": rows})


if __name__ == "__main__":
    main()
