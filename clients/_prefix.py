"""What a router knows of the engines' prefix caches: the fleet's KV index's answer for a request (`IndexedPrefix`,
what the engines reported) or, while the index is unavailable, its own memory of what it sent where
(`PrefixIndex`).

The memory does not observe an engine's cache; it assumes an engine still holds the blocks of the prompts it was
sent most recently, up to `capacity` (engine, block) entries across all engines, forgetting the oldest
first (engines evict least recently used blocks too). Dynamo's and vLLM's KV-aware routers make the same
approximation when they do not subscribe to the engines' cache events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class IndexedPrefix:
    """The KV index's answer (MatchPrefixes) for one request: its chain's length in blocks of `block_size`
    tokens, and how many leading blocks of it each indexed engine holds (an engine not named holds none)."""

    blocks: int
    block_size: int
    matched: Mapping[str, int] = field(default_factory=dict)

    def uncached(self, engine_id: str) -> int:
        """The request's blocks the engine lacks."""
        return self.blocks - self.matched.get(engine_id, 0)


class PrefixIndex:
    """A bounded LRU of (engine id, chained block hash)."""

    def __init__(self, capacity: int = 1 << 18) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, not {capacity}")
        self.capacity = capacity
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def record(self, engine_id: str, blocks: Sequence[int]) -> None:
        """engine_id was sent a prompt with these chained block hashes."""
        seen = self._seen
        for block in blocks:
            key = (engine_id, block)
            if key in seen:
                seen.move_to_end(key)
            else:
                seen[key] = None
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def matched(self, engine_id: str, blocks: Sequence[int]) -> int:
        """How many leading blocks engine_id likely holds (hashes chain: the first miss ends the match)."""
        seen = self._seen
        for count, block in enumerate(blocks):
            if (engine_id, block) not in seen:
                return count
        return len(blocks)
