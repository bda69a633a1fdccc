"""The prefix cache as a side channel between tenants, measured.

A victim tenant sends one of two prompts at random; the prompts differ in their first 64 tokens (the
secret) and share the rest. An attacker tenant then sends the first of the two and guesses "the victim
sent this one" from what it sees: the `cached_tokens` its own request reports, and its time to first
token. Over many trials (a fresh pair of prompts each) the attacker's guesses are scored by ROC AUC:
1.0 is a perfect spy, 0.5 a coin. With `--shared-prefix-cache` the cache answers the question; with
tenants isolated (the default with `--api-keys-file`) neither signal should carry anything.

    python bench/bench_side_channel.py            # 300 trials per mode
    python bench/bench_side_channel.py --trials 40

Each mode runs its own daemon (the tiny model, no SSD store), started here. Results go to
bench/results/side_channel.json.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from tests.daemon import PATIENCE, start_daemon  # noqa: E402

SECRET_TOKENS = 64  # what the attacker wants to learn: which of two 64-token beginnings the victim sent
SHARED_TOKENS = 192  # the rest of each prompt: the two prompts fill two 128-token blocks
KEYS = {"victim-key": "victim", "attacker-key": "attacker"}


@dataclass(frozen=True)
class Probe:
    victim_sent_probe: bool  # the truth the attacker guesses
    cached_tokens: int  # what the attacker's own request reported
    ttft: float  # the attacker's request, sent with max_tokens 1: seconds to its first (only) token


def keys_file(folder: Path) -> Path:
    path = folder / "keys"
    path.write_text("".join(f"{key} {tenant}\n" for key, tenant in KEYS.items()))
    return path


@contextlib.contextmanager
def tenants_daemon(shared: bool, extra: Sequence[str] = ()) -> Iterator[str]:
    """A daemon whose keys file names a victim and an attacker; their caches shared or not."""
    with tempfile.TemporaryDirectory(prefix="v4serve-tenants-") as folder:
        args = ["--api-keys-file", str(keys_file(Path(folder))), *extra]
        running = start_daemon(*args, *(["--shared-prefix-cache"] if shared else []))
        try:
            yield running.url
        finally:
            running.stop()


def send(client: httpx.Client, key: str, prompt: list[int]) -> tuple[int, float]:
    """(cached_tokens, seconds) of one one-token completion sent as `key`."""
    t0 = time.perf_counter()
    resp = client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": "v4serve-tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    elapsed = time.perf_counter() - t0
    resp.raise_for_status()
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"], elapsed


def trials(url: str, count: int, seed: int = 0, vocab: int = 320) -> list[Probe]:
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(64, vocab) for _ in range(n)]

    probes = []
    with httpx.Client(base_url=url, timeout=PATIENCE) as client:
        for _ in range(count):
            rest = draw(SHARED_TOKENS)
            candidates = [draw(SECRET_TOKENS) + rest, draw(SECRET_TOKENS) + rest]
            sent = rng.randrange(2)
            send(client, "victim-key", candidates[sent])
            cached, ttft = send(client, "attacker-key", candidates[0])
            probes.append(Probe(sent == 0, cached, ttft))
    return probes


def roc_auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """P(score of a positive > score of a negative), ties counting half (Mann-Whitney U)."""
    positives = [s for s, y in zip(scores, labels, strict=True) if y]
    negatives = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not positives or not negatives:
        return 0.5
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def attacker_scores(probes: Sequence[Probe]) -> dict[str, float]:
    """The attacker's ROC AUC from each signal, and its accuracy from the better rule of each:
    "sent" when some tokens were cached; "sent" when faster than the median."""
    labels = [p.victim_sent_probe for p in probes]
    median = sorted(p.ttft for p in probes)[len(probes) // 2]
    cached_guess = [p.cached_tokens > 0 for p in probes]
    ttft_guess = [p.ttft < median for p in probes]
    return {
        "auc_cached_tokens": roc_auc([p.cached_tokens for p in probes], labels),
        "auc_ttft": roc_auc([-p.ttft for p in probes], labels),
        "accuracy_cached_tokens": sum(g == y for g, y in zip(cached_guess, labels, strict=True)) / len(probes),
        "accuracy_ttft": sum(g == y for g, y in zip(ttft_guess, labels, strict=True)) / len(probes),
        "max_cached_tokens": max(p.cached_tokens for p in probes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = {}
    for mode, shared in (("shared (--shared-prefix-cache)", True), ("isolated (default)", False)):
        with tenants_daemon(shared) as url:
            probes = trials(url, args.trials, args.seed)
        results[mode] = {**attacker_scores(probes), "trials": len(probes),
                         "probes": [asdict(p) for p in probes]}
    rows = [[mode, r["auc_cached_tokens"], r["accuracy_cached_tokens"], r["auc_ttft"], r["accuracy_ttft"],
             r["max_cached_tokens"]] for mode, r in results.items()]
    print_table(f"The attacker's guess of the victim's prompt ({args.trials} trials per mode; AUC 0.5 = a coin)",
                ["cache", "AUC cached_tokens", "acc. cached_tokens", "AUC TTFT", "acc. TTFT", "max cached"], rows)
    write_results("side_channel", {"trials": args.trials, "seed": args.seed, "modes": results})


if __name__ == "__main__":
    main()
