"""Agent conversations replayed over HTTP: how much of each turn the prefix cache serves.

A synthetic agent trace: C concurrent conversations of T turns over one shared system prompt with
tool definitions (~4K tokens); each turn adds 200–2,000 new tokens and gets 100–400 output tokens
(greedy, lowercase letters, so replies round-trip exactly as token ids). Replayed per SWA mode
against a fresh daemon with its own SSD store, then once more after a restart on that store (each
conversation's next turn). Reported per mode:

- hit rate: cached / prompt tokens, for follow-up turns;
- the theoretical maximum: everything but each turn's new tokens and the reply's last token (never
  computed), and the ratio of the two (the goal in `periodic`: ≥ 0.99);
- tokens recomputed to rebuild window state; mean TTFT of follow-up vs first turns;
- the same for the turn after a restart.

    .venv/bin/python bench/bench_conversations.py [--conversations 8] [--turns 10] [--modes periodic,full,zero]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from tests.daemon import daemon  # noqa: E402

LETTERS = {str(64 + c): 30 for c in range(ord("a"), ord("z") + 1)}  # byte tokens of a..z


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(64, 320) for _ in range(n)]


@dataclass
class Turn:
    first: bool
    prompt: int
    cached: int
    ideal: int  # all but the new tokens (and the last reply token, which was never computed)
    ttft: float


@dataclass
class Conversation:
    history: list[int]
    answered: int = 0  # tokens of the conversation up to the end of its last reply
    turns: list[Turn] = field(default_factory=list)


async def one_turn(client: httpx.AsyncClient, conv: Conversation, new: list[int], out: int, shared: int) -> None:
    first = not conv.turns
    conv.history += new
    body = {"prompt": conv.history, "max_tokens": out, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "logit_bias": LETTERS, "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, generated, usage = time.perf_counter(), None, [], {}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"turn {len(conv.turns) + 1} failed: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                tokens = (choice.get("logprobs") or {}).get("tokens") or []
                if tokens and ttft is None:
                    ttft = time.perf_counter() - t0
                generated += [64 + ord(c) for c in tokens]
    ideal = shared if first else conv.answered - 1
    conv.turns.append(Turn(first, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], ideal,
                           ttft or 0.0))
    conv.history += generated
    conv.answered = len(conv.history)


async def replay(url: str, conversations: list[Conversation], plan: list[list[tuple[list[int], int]]],
                 shared: int, label: str) -> None:
    total, done = sum(len(p) for p in plan), 0
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        async def run(c: int) -> None:
            nonlocal done
            for new, out in plan[c]:
                await one_turn(client, conversations[c], new, out, shared)
                done += 1
                print(f"{label}: {done}/{total} turns", file=sys.stderr, flush=True)

        await asyncio.gather(*(run(c) for c in range(len(conversations))))


def metric_total(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def summarize(turns: list[Turn]) -> dict[str, float]:
    follow = [t for t in turns if not t.first]
    cached, prompt, ideal = (sum(getattr(t, k) for t in follow) for k in ("cached", "prompt", "ideal"))
    return {"hit_rate": cached / max(prompt, 1), "max_hit_rate": ideal / max(prompt, 1),
            "ratio_to_max": cached / max(ideal, 1),
            "ttft_first_s": statistics.mean(t.ttft for t in turns if t.first) if any(t.first for t in turns) else 0.0,
            "ttft_follow_s": statistics.mean(t.ttft for t in follow) if follow else 0.0}


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    rng = random.Random(0)
    system = random_tokens(rng, args.system)
    plans = [[(random_tokens(rng, rng.randint(200, 2000)), rng.randint(100, 400)) for _ in range(args.turns)]
             for _ in range(args.conversations)]
    after = [[(random_tokens(rng, rng.randint(200, 2000)), rng.randint(100, 400))] for _ in range(args.conversations)]
    conversations = [Conversation(list(system)) for _ in range(args.conversations)]
    flags = ("--swa-cache-mode", mode, "--max-model-len", str(args.max_model_len), "--max-num-seqs",
             str(args.conversations))
    with tempfile.TemporaryDirectory() as store:
        with daemon(*flags, "--kv-store-dir", store, timeout=180) as url:
            asyncio.run(replay(url, conversations, plans, len(system), f"{mode} live"))
            recomputed = metric_total(url, "v4serve_swa_recompute_tokens_total")
        live = summarize([t for c in conversations for t in c.turns])
        live["recomputed_tokens"] = recomputed
        seen = [len(c.turns) for c in conversations]
        with daemon(*flags, "--kv-store-dir", store, timeout=180) as url:  # the next day: a restart
            asyncio.run(replay(url, conversations, after, len(system), f"{mode} after restart"))
            disk = metric_total(url, "v4serve_prefix_cache_hits_total")
        restarted = summarize([t for c, n in zip(conversations, seen, strict=True) for t in c.turns[n:]])
        restarted["hit_tokens"] = disk
    return {"live": live, "after_restart": restarted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system", type=int, default=4096, help="shared system prompt + tools, tokens")
    parser.add_argument("--modes", default="periodic,full,zero")
    parser.add_argument("--max-model-len", type=int, default=32768)
    args = parser.parse_args()
    results = {mode: run_mode(mode, args) for mode in args.modes.split(",")}
    rows = []
    for mode, r in results.items():
        for phase in ("live", "after_restart"):
            s = r[phase]
            rows.append([mode, phase, s["hit_rate"], s["max_hit_rate"], s["ratio_to_max"],
                         s.get("recomputed_tokens", "-"), s["ttft_first_s"] if phase == "live" else "-",
                         s["ttft_follow_s"], s["ttft_first_s"] / s["ttft_follow_s"] if phase == "live" else "-"])
    print_table(f"{args.conversations} conversations x {args.turns} turns, {args.system}-token shared prefix "
                "(follow-up turns; ratio = hit rate / its maximum)",
                ["mode", "phase", "hit rate", "max", "ratio", "recomputed", "TTFT first s", "TTFT follow s",
                 "first/follow"], rows)
    write_results("bench_conversations", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
