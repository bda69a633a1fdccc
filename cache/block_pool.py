"""The Block Cache's bookkeeping: block ids, refcounts, sealing, the hash chain and eviction.

Plain Python, no torch. A block is either
- free: refcount 0, no hash; reused first;
- cached: refcount 0 with a hash; findable by prefix lookups until evicted;
- in use: refcount > 0 (private while being filled, or sealed and possibly shared).
Free and cached blocks share one queue: unhashed ones at the front, cached ones appended as they
are released, so allocation takes plain free blocks first and then evicts cached blocks, least
recently used first, but leaves before the blocks they hang off: a cached block that other
findable blocks continue (a shared head: a system prompt, a conversation's early turns) goes only
once nothing continues it, so losing one block never makes a long prefix unmatchable from the
middle. A block in use is never in the queue, so it can never be evicted.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# tokens(start, end) → the sequence's token ids [start, end), without building the whole list.
TokenSlice = Callable[[int, int], Sequence[int]]


# The chain's version, in its root: 2 hashes a block's ids packed as little-endian int64 (1 hashed their
# decimal text: 14 us a 128-token block against 2, 8 ms of a 64K-token prompt's arrival on the engine
# thread). No hash of one version equals one of the other: an SSD store's files of version 1 are misses,
# evicted as space is needed.
ROOT_TAG = b"v4serve-root-2\0"


def root_hash(namespace: bytes, cache_salt: str | None) -> bytes:
    """Root of a request's hash chain: the model/layout namespace and the tenant's salt."""
    return hashlib.sha256(ROOT_TAG + namespace + b"\0" + (cache_salt or "").encode()).digest()


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """h_i = H(h_{i-1}, tokens of block i); stable across processes and machines (the SSD store relies on
    it): SHA-256 of the parent, a NUL and the ids as little-endian int64."""
    return hashlib.sha256(parent + b"\0" + _ids_struct(len(tokens)).pack(*tokens)).digest()


@functools.lru_cache(maxsize=256)
def _ids_struct(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}q")


def extend_chain(hashes: list[bytes], root: bytes, tokens: TokenSlice, num_tokens: int, block_size: int) -> None:
    """Append the hashes of the blocks of the first `num_tokens` tokens completed since `hashes`
    was last extended."""
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_tokens // block_size):
        parent = chain_hash(parent, tokens(i * block_size, (i + 1) * block_size))
        hashes.append(parent)


def block_hashes(root: bytes, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Hashes of every complete block of `tokens`."""
    hashes: list[bytes] = []
    extend_chain(hashes, root, lambda start, end: tokens[start:end], len(tokens), block_size)
    return hashes


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    parent_hash: bytes | None = None  # the hash of the block this one continues (None: the first)


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the Block Cache needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self._children: dict[bytes, int] = {}  # findable blocks continuing each hash
        self.evictions = 0
        self.on_forget: Callable[[bytes], None] | None = None  # told each hash that stops being findable

    # ---- queries --------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take (free or evictable cached)."""
        return len(self._queue)

    @property
    def num_cached(self) -> int:
        return sum(1 for i in self._queue if self.blocks[i].block_hash is not None)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._queue)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def cached_block(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def longest_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest run of leading hashes that are cached (in use or not)."""
        hit = []
        for h in hashes:
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    # ---- changes --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n private blocks with refcount 1, evicting the least recently used cached ones."""
        if n > len(self._queue):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._queue)} free")
        out = []
        for _ in range(n):
            block_id = self._next_victim()
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._forget(block)
                self.evictions += 1
            block.ref_count = 1
            out.append(block_id)
        return out

    def _next_victim(self) -> int:
        """Leave the queue: the first free block, else the least recently used cached leaf (a block
        nothing continues), else (only heads left, their children in use) the least recently used."""
        victim = next((i for i in self._queue if not self._children.get(self.blocks[i].block_hash or b"")),
                      next(iter(self._queue)))
        del self._queue[victim]
        return victim

    def take(self, block_ids: Iterable[int]) -> None:
        """Add a reference to cached blocks (a prefix hit); they leave the eviction queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is None:
                raise ValueError(f"block {block_id} is not sealed; only sealed blocks are shared")
            if block.ref_count == 0:
                del self._queue[block_id]
            block.ref_count += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per block. Pass a table tail-first so that, among blocks freed
        together, the earliest blocks of a prefix are evicted last."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} released more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._queue[block_id] = None
                if block.block_hash is None:
                    self._queue.move_to_end(block_id, last=False)

    def seal(self, block_id: int, block_hash: bytes, parent_hash: bytes | None = None) -> bool:
        """Mark a full private block shareable under its chain hash (continuing `parent_hash`). If
        another block already holds that hash (two requests computed the same prefix), this one
        stays unshared and is recycled when released. Returns whether the block became findable."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise ValueError(f"block {block_id} is not in use")
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._by_hash:
            return False
        block.block_hash, block.parent_hash = block_hash, parent_hash
        self._by_hash[block_hash] = block_id
        if parent_hash is not None:
            self._children[parent_hash] = self._children.get(parent_hash, 0) + 1
        return True

    def reset(self) -> int:
        """Forget every cached block that no request holds (reset_prefix_cache). Blocks in use
        keep their hashes: they are still valid and shared."""
        dropped = 0
        for block_id in list(self._queue):
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._forget(block)
                dropped += 1
        return dropped

    def _forget(self, block: Block) -> None:
        assert block.block_hash is not None
        if self._by_hash.get(block.block_hash) == block.block_id:
            del self._by_hash[block.block_hash]
            if self.on_forget is not None:
                self.on_forget(block.block_hash)
            if block.parent_hash is not None:
                left = self._children[block.parent_hash] - 1
                if left:
                    self._children[block.parent_hash] = left
                else:
                    del self._children[block.parent_hash]
        block.block_hash = block.parent_hash = None

    # ---- invariants -----------------------------------------------------------------------
    def check_integrity(self, tables: Iterable[Sequence[int]] | None = None) -> None:
        """free + cached + used == total; queue holds exactly the refcount-0 blocks; the hash
        index points at blocks carrying that hash; with `tables`, refcounts equal the number of
        block-table references."""
        queued = set(self._queue)
        free = sum(1 for i in queued if self.blocks[i].block_hash is None)
        cached = len(queued) - free
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert free + cached + used == self.num_blocks, (free, cached, used, self.num_blocks)
        for block in self.blocks:
            assert (block.ref_count == 0) == (block.block_id in queued), block
            assert block.ref_count >= 0, block
        for h, block_id in self._by_hash.items():
            assert self.blocks[block_id].block_hash == h, (block_id, h)
        children: dict[bytes, int] = {}
        for block_id in self._by_hash.values():
            parent = self.blocks[block_id].parent_hash
            if parent is not None:
                children[parent] = children.get(parent, 0) + 1
        assert children == self._children, (children, self._children)
        if tables is not None:
            counts = [0] * self.num_blocks
            for table in tables:
                for block_id in table:
                    counts[block_id] += 1
            for block in self.blocks:
                assert block.ref_count == counts[block.block_id], (block, counts[block.block_id])
