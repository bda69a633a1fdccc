"""The KV cache's frozen configuration, built once at start from the model and the serve flags."""

from __future__ import annotations

from dataclasses import dataclass

# How window state is snapshotted (written; whatever snapshots exist are used for restores in every mode):
# at every sealed boundary, every interval and at prompt and response ends, never, or per prefix:
# `zero` until a prefix is hit, `periodic` from then on (see StateCache.snapshot_mode).
SWA_CACHE_MODES = ("full", "periodic", "zero", "auto")

# Slot states one step may capture inside its prefill chunks (cache/state_capture.py): they wait on the
# device until the step ends, so past this many a chunk ends on the next snapshot point instead. 16 is
# one 2,048-token chunk of `full` at 128-token blocks; the capacity plan reserves their bytes.
MAX_CAPTURED_STATES = 16


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    window: int
    num_layers: int
    num_slots: int
    num_blocks: int
    swa_cache_mode: str = "periodic"
    swa_checkpoint_interval: int = 4096
    enable_prefix_caching: bool = True
    snapshot_bytes: int = 1 << 30
    # Widest compressor overlap (CSA ratio): its tail rows must also be exact after a zero-mode
    # recompute, so the recompute span covers at least that many tokens per layer.
    overlap_ratio: int = 0
    # auto mode: seconds a hit keeps its prefix hot (its window state snapshotted) after the last hit.
    hot_seconds: float = 3600.0
    max_hot_prefixes: int = 1 << 16  # hot prefix nodes remembered (the least recently hit go first)
    # Snapshots at boundaries inside a prefill chunk are assembled from the rows the chunk wrote
    # (cache/state_capture.py), so chunks need not end on them. Off with a multi-token-prediction
    # layer, whose slot also holds a hidden state the capture does not keep: chunks end on them there.
    snapshots_inside_chunks: bool = True

    def __post_init__(self) -> None:
        if self.swa_cache_mode not in SWA_CACHE_MODES:
            raise ValueError(f"swa_cache_mode must be one of {SWA_CACHE_MODES}, got {self.swa_cache_mode!r}")
        if self.swa_checkpoint_interval <= 0 or self.swa_checkpoint_interval % self.block_size:
            raise ValueError(f"swa_checkpoint_interval must be a positive multiple of the block size "
                             f"({self.block_size}), got {self.swa_checkpoint_interval}")

    @property
    def zero_mode_span(self) -> int:
        """Tokens recomputed before a hit boundary to rebuild the state from nothing."""
        return max(self.window - 1, self.overlap_ratio) * self.num_layers

    def blocks_needed(self, num_tokens: int, have: int = 0) -> int:
        """Blocks to add to a table of `have` blocks so it covers num_tokens."""
        return max(0, -(-num_tokens // self.block_size) - have)

    def reusable_blocks(self, num_tokens: int) -> int:
        """The most leading blocks of a sequence a prefix hit may cover: the last known token is
        always computed, since its logits are what the request needs next."""
        return (num_tokens - 1) // self.block_size if num_tokens > 1 else 0
