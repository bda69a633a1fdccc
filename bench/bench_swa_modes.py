"""What each SWA cache mode costs and buys on a workload with a realistic reuse skew.

The same seeded workload runs against each `--swa-cache-mode` (a fresh engine on the embedded tiny
model with its own SSD store folder), one request at a time:
- a few long documents, each asked many times (a different question each time): the hot prefixes;
- many one-off prompts as long as the documents: cold, never asked again;
- agent conversations: each turn the whole conversation so far, a tool result and a reply longer.

Printed side by side: window-snapshot bytes written to the SSD store (and all bytes), what the store
holds at the end, cold TTFT (the price of writing snapshots on the request that writes them), hit TTFT
(mean and p95), tokens recomputed to restore window state, prefix hit rate; then ratios to `periodic`
and the design's arithmetic at this scale: one document asked 100 times, cold every time against
computed once and hit 99 times (from the measured mean cold and hit TTFTs).

    python bench/bench_swa_modes.py                 # 16K-token documents (a few minutes)
    python bench/bench_swa_modes.py --doc-tokens 4096 --quick

Results: bench/results/swa_modes.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, time_to_first_token, write_results  # noqa: E402
from v4serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny  # noqa: E402
from v4serve.engine.request import Request, SamplingParams  # noqa: E402

MODES = ("full", "periodic", "zero", "auto")


@dataclass(frozen=True)
class Ask:
    kind: str  # "document", "one-off" or "agent"
    prompt: tuple[int, ...]  # an agent's later turn: only what it adds (a tool's output)
    max_tokens: int = 2
    follows: int | None = None  # an agent's later turn: the index of its previous turn


def workload(doc_tokens: int, docs: int, asks: int, one_offs: int, agents: int, turns: int, seed: int) -> list[Ask]:
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(64, 320) for _ in range(n)]

    documents = [draw(doc_tokens) for _ in range(docs)]
    jobs = [Ask("document", tuple(d + draw(48))) for d in documents for _ in range(asks)]
    jobs += [Ask("one-off", tuple(draw(doc_tokens + 48))) for _ in range(one_offs)]
    rng.shuffle(jobs)
    # An agent's turns stay in order, spread through the rest: each turn is the previous turn's prompt,
    # its reply (generated, 32 tokens) and a tool's output.
    for _ in range(agents):
        at, previous = rng.randrange(len(jobs) + 1), None
        for t in range(turns):
            added = draw(doc_tokens // 4 if t == 0 else 200)
            at = min(at, len(jobs))
            jobs = [replace(j, follows=j.follows + 1) if j.follows is not None and j.follows >= at else j
                    for j in jobs]
            jobs.insert(at, Ask("agent", tuple(added), 32, previous))
            previous, at = at, at + 1 + rng.randrange(1, 4)
    return jobs


@dataclass
class Measured:
    ttft: float
    kind: str
    hit: int
    recomputed: int


def run_mode(model, mode: str, jobs: list[Ask], max_len: int, interval: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"v4serve-swa-{mode}-") as store:
        engine = LLMEngine(model, EngineConfig(max_model_len=max_len, max_num_seqs=2, swa_cache_mode=mode,
                                               swa_checkpoint_interval=interval, kv_store_dir=store,
                                               kv_store_read_timeout=600.0, max_num_batched_tokens=2048,
                                               max_prefill_chunk=2048))
        measured, sent = [], []
        for i, job in enumerate(jobs):
            prompt = list(job.prompt)
            if job.follows is not None:
                before = sent[job.follows]
                prompt = before.all_token_ids + prompt
            req = Request(f"{mode}-{i}", prompt, SamplingParams(max_tokens=job.max_tokens, ignore_eos=True))
            sent.append(req)
            ttft = time_to_first_token(engine, req)
            engine.kv.store.flush(600.0)  # the next request's lookups see every file this one wrote
            measured.append(Measured(ttft, job.kind, req.num_hit_tokens, req.num_recomputed_tokens))
        stats = engine.stats()
        store_bytes = engine.kv.store.used_bytes
        engine.close()
    hits = [m.ttft for m in measured if m.hit]
    colds = [m.ttft for m in measured if not m.hit]
    queries = sum(r.num_prompt_tokens for r in sent)
    return {
        "snapshot_bytes_disk": stats.snapshot_bytes_disk, "bytes_written": stats.store_written_bytes,
        "store_bytes_end": store_bytes, "snapshot_bytes_host": stats.snapshot_bytes_host,
        "cold_ttft_mean": statistics.mean(colds) if colds else 0.0,
        "hit_ttft_mean": statistics.mean(hits) if hits else 0.0,
        "hit_ttft_p95": sorted(hits)[int(0.95 * (len(hits) - 1))] if hits else 0.0,
        "recomputed_tokens": sum(m.recomputed for m in measured),
        "hit_rate": sum(m.hit for m in measured) / queries, "hits": len(hits), "colds": len(colds),
        "write_modes": dict(stats.write_modes), "restores": dict(stats.restores),
        "document_hit_ttft": statistics.mean([m.ttft for m in measured if m.hit and m.kind == "document"] or [0.0]),
    }


def cold_ttfts(model, doc_tokens: int, interval: int, repeats: int, seed: int) -> dict[str, float]:
    """Median cold TTFT of a fresh prompt per mode, the modes taking turns (A B C D A B C D ...) so the
    machine's noise lands on all alike: what writing snapshots costs the request that writes them."""
    rng = random.Random(seed + 1)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="v4serve-swa-cold-") as root:
        engines = {mode: LLMEngine(model, EngineConfig(
            max_model_len=doc_tokens + 16, max_num_seqs=2, swa_cache_mode=mode, swa_checkpoint_interval=interval,
            kv_store_dir=f"{root}/{mode}", max_num_batched_tokens=2048, max_prefill_chunk=2048)) for mode in MODES}
        for r in range(repeats + 1):  # the first round warms each engine up and is not counted
            for mode, engine in engines.items():
                req = Request(f"cold-{mode}-{r}", [rng.randrange(64, 320) for _ in range(doc_tokens)],
                              SamplingParams(max_tokens=1, ignore_eos=True))
                ttft = time_to_first_token(engine, req)
                if r:
                    times[mode].append(ttft)
                engine.kv.store.flush(600.0)  # the writes finish outside the next request's time
        for engine in engines.values():
            engine.close()
    return {mode: statistics.median(ts) for mode, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc-tokens", type=int, default=16384)
    parser.add_argument("--docs", type=int, default=2)
    parser.add_argument("--asks", type=int, default=8, help="questions per document")
    parser.add_argument("--one-offs", type=int, default=12)
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--interval", type=int, default=4096, help="--swa-checkpoint-interval")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="fewer requests: 2 docs × 4, 3 one-offs, 1 agent")
    parser.add_argument("--cold-repeats", type=int, default=3, help="rounds of the interleaved cold-TTFT measurement")
    parser.add_argument("--cold-only", action="store_true", help="only the interleaved cold-TTFT measurement")
    args = parser.parse_args()
    if args.quick:
        args.asks, args.one_offs, args.agents = 4, 3, 1
    jobs = workload(args.doc_tokens, args.docs, args.asks, args.one_offs, args.agents, args.turns, args.seed)
    model = build_tiny()
    cold = cold_ttfts(model, args.doc_tokens, args.interval, args.cold_repeats, args.seed)
    print_table(f"cold TTFT of a fresh {args.doc_tokens}-token prompt, modes in turns, median of {args.cold_repeats} "
                "(goal: ≤ 1.1× zero's, which writes no snapshots)",
                ["mode", "cold TTFT s", "/ zero"], [[m, t, t / cold["zero"]] for m, t in cold.items()])
    if args.cold_only:
        write_results("swa_modes_cold", {"settings": vars(args), "cold_ttft": cold})
        return
    max_len = args.doc_tokens + 64 + args.turns * 240
    results = {}
    for mode in MODES:
        print(f"{mode}: {len(jobs)} requests ...", flush=True)
        results[mode] = run_mode(model, mode, jobs, max_len, args.interval)
    mib = 2**20
    rows = [[mode, r["snapshot_bytes_disk"] / mib, r["bytes_written"] / mib, r["store_bytes_end"] / mib,
             r["cold_ttft_mean"], r["hit_ttft_mean"], r["hit_ttft_p95"], r["recomputed_tokens"], r["hit_rate"]]
            for mode, r in results.items()]
    print_table(f"SWA cache modes: {len(jobs)} requests, {args.doc_tokens}-token documents ({args.docs} asked "
                f"{args.asks}× each), {args.one_offs} one-offs, {args.agents} agents × {args.turns} turns",
                ["mode", "snapshot MiB", "written MiB", "store MiB", "cold TTFT s", "hit TTFT s", "hit p95 s",
                 "recomputed", "hit rate"], rows)
    periodic, zero = results["periodic"], results["zero"]
    ratio_rows = []
    for mode, r in results.items():
        ratio_rows.append([mode, r["snapshot_bytes_disk"] / max(periodic["snapshot_bytes_disk"], 1),
                           r["hit_ttft_mean"] / periodic["hit_ttft_mean"],
                           zero["document_hit_ttft"] / r["document_hit_ttft"],
                           r["cold_ttft_mean"] / zero["cold_ttft_mean"]])
    print_table("ratios (goals for auto: snapshots ≤ 0.3× periodic's, hit TTFT ≤ 1.2× periodic's, document hits "
                "≥ 3× faster than zero's; cold TTFT ≤ 1.1× zero's)",
                ["mode", "snapshots / periodic", "hit TTFT / periodic", "zero / doc hit TTFT", "cold TTFT / zero"],
                ratio_rows)
    hundred = [[mode, 100 * r["cold_ttft_mean"], r["cold_ttft_mean"] + 99 * r["document_hit_ttft"],
                100 * r["cold_ttft_mean"] / (r["cold_ttft_mean"] + 99 * r["document_hit_ttft"])]
               for mode, r in results.items()]
    print_table(f"one {args.doc_tokens}-token document asked 100 times (from the mean cold and document-hit TTFTs)",
                ["mode", "cold ×100 s", "cold + 99 hits s", "saving ×"], hundred)
    write_results("swa_modes", {"settings": vars(args), "requests": len(jobs), "cold_ttft": cold, "modes": results})


if __name__ == "__main__":
    main()
