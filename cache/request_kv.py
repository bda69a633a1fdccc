"""One request's cache state, owned by `cache/`. The engine keeps it as one opaque handle on its
request and passes it back to `KVCacheManager` to plan, admit, grow, advance (seal and snapshot)
and free; only this package reads or changes its fields."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefixPlan:
    """How a request starts: which cached blocks it takes and where computation resumes."""

    hit_blocks: tuple[int, ...]  # cached block ids to take, in order
    hit_tokens: int  # tokens whose compressed entries come from the cache (blocks, plus a response's tail)
    resume_from: int  # where computation resumes
    snapshot_key: bytes | None  # sealed snapshot restoring the slot at `resume_from`, if any
    # An end-of-response snapshot: the slot at `resume_from`, inside a block, with that block's entries.
    response_key: bytes | None = None

    @property
    def recompute_tokens(self) -> int:
        return self.hit_tokens - self.resume_from

    @property
    def window_from(self) -> int:
        """Window KV below this position is absent (zero-mode recompute starts empty)."""
        return 0 if self.snapshot_key is not None or self.response_key is not None else self.resume_from

    @property
    def restore_point(self) -> str | None:
        """How the slot's state was restored: at the hit's end from a sealed snapshot ("block"), from
        an earlier one then recomputing ("snapshot"), from an end-of-response snapshot, or rebuilt
        from nothing ("recompute"); None without a hit."""
        if not self.hit_tokens:
            return None
        if self.response_key is not None:
            return "response_end"
        if self.snapshot_key is not None:
            return "block" if self.resume_from == self.hit_tokens else "snapshot"
        return "recompute"


NO_HIT = PrefixPlan(hit_blocks=(), hit_tokens=0, resume_from=0, snapshot_key=None)


@dataclass
class RequestKV:
    root: bytes  # hash-chain root: the model namespace and the tenant's cache salt
    block_hashes: list[bytes] = field(default_factory=list)  # of every complete block of the known tokens
    slot: int | None = None  # State Cache slot while admitted
    block_table: list[int] = field(default_factory=list)  # Block Cache ids while admitted
    num_sealed: int = 0  # leading blocks of the table that are sealed (hashed, shareable)
    plan: PrefixPlan = NO_HIT  # the prefix hit of the latest admission
    disk_checked: bool = False  # the SSD store has been asked for the last time (`start_disk_load`)
    disk_load: Future | None = None  # a store read in flight while the request waits
    disk_tokens: int = 0  # tokens whose entries the SSD store supplied for this request
    fetch: Future | None = None  # a decode replica's fetch of its prompt's KV from a prefill replica, in flight
    swa_mode: str = "periodic"  # how this request writes window snapshots (the daemon's, or its own)
    hot: bool = False  # auto mode: its prefix was hit (or is known hot), so it snapshots as periodic

    @property
    def frozen_until(self) -> int:
        """Compressed entries below this position came from the cache: read, never written."""
        return self.plan.hit_tokens

    @property
    def window_from(self) -> int:
        """Window KV below this position is absent while the state is rebuilt after a hit."""
        return self.plan.window_from

    def state_exact_at(self, position: int) -> bool:
        """Whether the slot state at `position` is the one a cold run would have."""
        return self.window_from == 0 or position >= self.frozen_until
