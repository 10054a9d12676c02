"""The memory store's kept answers (AIP-155): oldest first, bounded in bytes over all and per owner.

An answer costs its key and value bytes plus `ANSWER_OVERHEAD_BYTES`. Putting one past a bound first drops
the owner's oldest answers, then the oldest of all: a caller that floods the cache loses its own retries'
answers before anyone else's. An answer larger than a bound is not kept. Without an owner ("", auth off) only
the global bound applies, as for the memory budget (rendezvous.core.budget).
"""

from __future__ import annotations

from collections import OrderedDict

ANSWER_OVERHEAD_BYTES = 128
"""A kept answer's own objects (its entry, tuple, key and bytes headers), over its key and value bytes."""


def answer_cost(key: str, value: bytes) -> int:
    """The bytes a kept answer is counted as."""
    return len(key) + len(value) + ANSWER_OVERHEAD_BYTES


class Answers:
    """Answers by key, each with its expiry (a loop time) and owner."""

    def __init__(self, max_bytes: int, max_bytes_per_owner: int) -> None:
        self._entries: OrderedDict[str, tuple[float, bytes, str, int]] = OrderedDict()
        self._owned: dict[str, OrderedDict[str, None]] = {}  # each owner's keys, oldest first
        self._owner_bytes: dict[str, int] = {}
        self._max_bytes = max_bytes
        self._max_owner_bytes = max_bytes_per_owner
        self.bytes = 0

    def owner_bytes(self, owner: str) -> int:
        """What owner's kept answers cost (0 for "")."""
        return self._owner_bytes.get(owner, 0) if owner else 0

    def get(self, key: str, now: float) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] < now:
            self._drop(key)
            return None
        return entry[1]

    def put(self, key: str, value: bytes, now: float, ttl: float, owner: str) -> None:
        self._drop(key)
        while self._entries:  # the expired, oldest first (one ttl: expiry follows insertion)
            oldest = next(iter(self._entries))
            if self._entries[oldest][0] >= now:
                break
            self._drop(oldest)
        cost = answer_cost(key, value)
        if cost > self._max_bytes or (owner and cost > self._max_owner_bytes):
            return
        if owner:
            owned = self._owned.get(owner)
            while owned and self._owner_bytes[owner] + cost > self._max_owner_bytes:
                self._drop(next(iter(owned)))
                owned = self._owned.get(owner)
        while self._entries and self.bytes + cost > self._max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = (now + ttl, value, owner, cost)
        self.bytes += cost
        if owner:
            self._owned.setdefault(owner, OrderedDict())[key] = None
            self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + cost

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        _, _, owner, cost = entry
        self.bytes -= cost
        if owner:
            owned = self._owned[owner]
            del owned[key]
            left = self._owner_bytes[owner] - cost
            if owned:
                self._owner_bytes[owner] = left
            else:
                del self._owned[owner]
                del self._owner_bytes[owner]
