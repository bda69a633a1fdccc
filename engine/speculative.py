"""Speculative decoding: a decoding request's next few tokens guessed cheaply (drafts), then checked by
one forward pass of the model over the request's last token and its drafts.

Drafts are proposals fixed before the pass (n-gram drafts: copied from the request's own context), so
verifying them exactly is simple: each row of the pass is sampled as it would be without speculation
(the rows after a draft see the drafts before it as output), and drafts are accepted while each equals
the token sampled before it. The first sample that differs replaces its draft, and when every draft is
accepted the last row's sample comes free. A draft accepted this way is a sample from the model's own
distribution: the token a row draws equals the draft with the draft's probability under the model,
and a row whose draw differs has drawn from the rest of the distribution, renormalised — rejection
sampling for a proposal that puts all its mass on one token. Greedy output is the same with or without
speculation; seeded output is reproducible run to run (the rows draw from the request's generator in
order, so its draws fall differently than without speculation).

Rejected drafts leave no trace in the cache: the engine keeps a copy of the request's State Cache slot
(window rows, compressor tails) before the pass and puts it back when a draft is rejected; the request's
computed count then stays where it was, so its accepted tokens are computed again in its next chunk
(with the next drafts), and blocks are sealed only over tokens computed from accepted ones. Entries the
pass wrote past that point into the request's own unsealed blocks are rewritten before any query can
see them (an entry is visible only from its own position on).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METHODS = ("ngram", "mtp")
# Decode steps a request goes without drafts after its drafts keep failing (1, 2, 4, ... up to this):
# where the text does not repeat, proposals cost a wider pass and the recompute after a rejection.
MAX_DRAFT_BACKOFF = 16


def after_pass(pause_backoff: tuple[int, int], kept: int) -> tuple[int, int]:
    """A request's (draft pause, backoff) after a pass that kept `kept` drafts: none kept → skip the next
    `backoff` decode steps and double it; any kept → draft every step again."""
    _, backoff = pause_backoff
    if kept:
        return 0, 0
    backoff = min(MAX_DRAFT_BACKOFF, max(1, 2 * backoff))
    return backoff, backoff


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` shape: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": a, "prompt_lookup_max": b}, or {"method": "mtp", "num_speculative_tokens": k}
    (the checkpoint's multi-token-prediction layer, run k times on its own guesses: engine/mtp.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1  # n-gram drafts: the shortest suffix of the context looked up
    prompt_lookup_max: int = 4  # and the longest (tried first)

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From JSON text or a mapping (a `--config` file's value); ValueError says what is wrong."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 3}')
        unknown = set(value) - {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {sorted(unknown)}")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {list(METHODS)}, got {method!r}")
        if method == "mtp" and unknown_for_mtp(value):
            raise ValueError(f"--speculative-config: {sorted(unknown_for_mtp(value))} apply to method 'ngram' only")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer from 1 to 16, got {k!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        hi = cls.prompt_lookup_max if hi is None else hi
        lo = min(cls.prompt_lookup_min, hi) if lo is None else lo
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"--speculative-config: {name} must be a positive integer, got {n!r}")
        if lo > hi:
            raise ValueError(f"--speculative-config: prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
        return cls(method, k, lo, hi)

    def describe(self) -> str:
        if self.method == "mtp":
            return f"mtp, {self.num_speculative_tokens} draft tokens from the checkpoint's multi-token-prediction layer"
        return (f"{self.method}, {self.num_speculative_tokens} draft tokens, n-grams of "
                f"{self.prompt_lookup_min}..{self.prompt_lookup_max} tokens")


def unknown_for_mtp(value: dict[str, Any]) -> set[str]:
    """Keys of a --speculative-config that mean nothing for MTP drafts."""
    return set(value) & {"prompt_lookup_min", "prompt_lookup_max"}


def ngram_drafts(tokens: Sequence[int], k: int, shortest: int, longest: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the context's last n tokens,
    for the longest n from `longest` down to `shortest` that occurs earlier (agents re-emit what they
    read). Nothing when no suffix recurs."""
    if k < 1 or len(tokens) < shortest + 1:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    for n in range(min(longest, len(ids) - 1), shortest - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every n-gram but the suffix itself
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start:start + k].tolist()
    return []


def accepted_count(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """Drafts accepted: while each equals the token sampled at the row before it (row i samples the
    token that follows the request's last token and drafts[:i])."""
    j = 0
    while j < len(drafts) and sampled[j] == drafts[j]:
        j += 1
    return j


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters: passes with drafts, drafts proposed, drafts accepted, and
    accepted drafts by their place in the draft (how far acceptance reaches)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def count(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1
