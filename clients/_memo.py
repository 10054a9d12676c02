"""`remember`: a bounded memo of recent keys (transfers that ended, fences, claims), oldest dropped first."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def remember(memo: OrderedDict[K, V], key: K, value: V, keep: int) -> None:
    """Put `key` in `memo` as its newest entry, then drop the oldest while more than `keep` are held."""
    memo[key] = value
    memo.move_to_end(key)
    while len(memo) > keep:
        memo.popitem(last=False)
