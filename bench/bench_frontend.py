"""CPU per streamed token on each side of the engine's IPC: the daemon (tiny model) serves N
concurrent streaming completions read to the end by clients in this process, and the CPU time of the
front-end process (HTTP, detokenizing, SSE) and of the engine process (the forward included: the tiny
model runs on the CPU here; `bench/bench_host.py` gives the engine's output path alone) is read from
/proc before and after, divided by the tokens streamed.

    python bench/bench_frontend.py [--streams 64 256] [--tokens 128] [--prompt 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from tests.daemon import PATIENCE, start_daemon  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of one process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
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


def measure(url: str, pid: int, streams: int, tokens: int, prompt: int) -> dict[str, Any]:
    asyncio.run(load(url, 2, 8, prompt))  # warm: connections, first compiles
    procs = [pid, *children(pid)]
    before = {p: cpu_times(p) for p in procs}
    made, seconds = asyncio.run(load(url, streams, tokens, prompt))
    after = {p: cpu_times(p) for p in procs}
    spent = {p: sum(after[p]) - sum(before[p]) for p in procs}
    engine = max((p for p in procs if p != pid), key=lambda p: spent[p])  # the child that runs the model
    system = after[pid][1] - before[pid][1]  # the kernel's share: mostly a send() per chunk
    return {"streams": streams, "tokens": made, "seconds": seconds, "tokens_per_s": made / seconds,
            "front_end_us_per_token": spent[pid] / made * 1e6, "front_end_system_us_per_token": system / made * 1e6,
            "engine_us_per_token": spent[engine] / made * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    args = parser.parse_args()
    running = start_daemon("--max-num-seqs", str(max(args.streams)), "--max-model-len", "1024",
                           "--max-waiting", str(4 * max(args.streams)))
    try:
        rows = [measure(running.url, running.proc.pid, n, args.tokens, args.prompt) for n in args.streams]
    finally:
        running.stop()
    print_table(f"CPU per streamed token (tiny model; {args.prompt}-token prompts, {args.tokens} tokens a stream)",
                ["streams", "tokens/s", "front end us/token", "of which in the kernel",
                 "engine us/token (forward included)"],
                [[r["streams"], r["tokens_per_s"], r["front_end_us_per_token"], r["front_end_system_us_per_token"],
                  r["engine_us_per_token"]] for r in rows])
    write_results("frontend", {"tokens": args.tokens, "prompt": args.prompt, "rows": rows})


if __name__ == "__main__":
    main()
