"""State Cache slot allocator: one fixed-size slot per admitted request. Plain Python."""

from __future__ import annotations


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError("the State Cache needs at least one slot")
        self.num_slots = num_slots
        # Lowest slot first: keeps the set of touched slots compact and ids predictable.
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return len(self._used) / self.num_slots

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)

    def check_integrity(self) -> None:
        assert len(self._free) + len(self._used) == self.num_slots
        assert not set(self._free) & self._used
