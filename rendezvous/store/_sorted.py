"""`SortedIds`: a sorted set of strings for paging in id order (the memory store's ListTransfers index)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator

_LOAD = 512
"""Target bucket size: a bucket splits at twice this, so an insert moves at most ~1,000 pointers."""


class SortedIds:
    """Strings kept sorted in buckets of at most 2 x _LOAD, with each bucket's largest id alongside.

    Adding or removing an id costs a binary search plus a move within one bucket (not a move of the
    whole set, as one sorted list would); `after(key)` finds its start by binary search, so reading a
    page costs O(log n + page).
    """

    __slots__ = ("_buckets", "_len", "_maxes")

    def __init__(self) -> None:
        self._buckets: list[list[str]] = []
        self._maxes: list[str] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        i = bisect_left(self._maxes, key)
        if i == len(self._maxes):
            return False
        bucket = self._buckets[i]
        j = bisect_left(bucket, key)
        return j < len(bucket) and bucket[j] == key

    def __iter__(self) -> Iterator[str]:
        for bucket in self._buckets:
            yield from bucket

    def add(self, key: str) -> None:
        """Insert key (no-op when present)."""
        maxes, buckets = self._maxes, self._buckets
        if not buckets:
            buckets.append([key])
            maxes.append(key)
            self._len = 1
            return
        i = bisect_left(maxes, key)
        if i == len(maxes):  # beyond every id: append to the last bucket
            i -= 1
            bucket = buckets[i]
            bucket.append(key)
            maxes[i] = key
        else:
            bucket = buckets[i]
            j = bisect_left(bucket, key)
            if j < len(bucket) and bucket[j] == key:
                return
            bucket.insert(j, key)
        self._len += 1
        if len(bucket) > 2 * _LOAD:
            buckets[i : i + 1] = [bucket[:_LOAD], bucket[_LOAD:]]
            maxes[i : i + 1] = [bucket[_LOAD - 1], bucket[-1]]

    def discard(self, key: str) -> None:
        """Remove key (no-op when absent)."""
        maxes, buckets = self._maxes, self._buckets
        i = bisect_left(maxes, key)
        if i == len(maxes):
            return
        bucket = buckets[i]
        j = bisect_left(bucket, key)
        if j == len(bucket) or bucket[j] != key:
            return
        del bucket[j]
        self._len -= 1
        if not bucket:
            del buckets[i]
            del maxes[i]
        elif j == len(bucket):
            maxes[i] = bucket[-1]

    def after(self, key: str) -> Iterator[str]:
        """The ids greater than key, in order. Do not change the set while iterating."""
        i = bisect_right(self._maxes, key)
        if i == len(self._maxes):
            return
        buckets = self._buckets
        first = buckets[i]
        for j in range(bisect_right(first, key), len(first)):
            yield first[j]
        for k in range(i + 1, len(buckets)):
            yield from buckets[k]


__all__ = ["SortedIds"]
