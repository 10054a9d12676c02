"""What the fleet's KV index says a request's prompt finds cached on each engine, for the router's prefix-aware
policy (`IndexedPrefix`), or None so the router places by its own memory instead.

The router computes the prompt's chain as the engines do (rendezvous.connector.block_hashes) with the hashing the
engines announced, learned from the index's own answers (the first request asks once with a dummy chain), and asks
MatchPrefixes once per request for the route's prefill and decode pools together. The index is not asked for a
chat (the router does not apply the chat template, so its tokens are not the engine's), a text prompt without
`--tokenizer`, a prompt of less than one block, or engines whose hashing has no shared seed. While the index
fails or holds no engine of the route, the router does without it for `retry_interval` seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rendezvous.clients import BlockHashing, IndexedPrefix, PrefixMatch, RouterClient
from rendezvous.connector.block_hashes import chain, computable
from rendezvous.connector.prompts import PromptReader

__all__ = ["PrefixView"]

_ANY_CHAIN = (b"\0",)
"""A chain no engine holds: its answer lists the indexed engines and their hashing."""


class PrefixView:
    """Asks the KV index, for each request, how much of its prompt each engine of its route holds."""

    def __init__(
        self,
        engines: RouterClient,
        prompts: PromptReader,
        *,
        retry_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engines = engines
        self.prompts = prompts
        self.retry_interval = retry_interval
        self._clock = clock
        self._hashing: BlockHashing | None = None
        self._idle_until = 0.0

    async def lookup(self, body: Mapping[str, Any], pools: Sequence[str]) -> IndexedPrefix | None:
        """The index's answer for the request's prompt among `pools`' engines; None when there is none."""
        tokens = self.prompts.token_ids(body)
        if tokens is None or self._clock() < self._idle_until:
            return None
        hashing = self._hashing or await self._learn(pools)
        if hashing is None:
            return None
        hashes = chain(hashing, tokens)
        if not hashes:
            return None
        answers = await self.engines.index_matches(hashes, pools)
        if not answers:
            self._idle()
            return None
        self._hashing = _hashing(answers) or hashing  # an engine restarted with another hashing: next time
        return IndexedPrefix(
            len(hashes), hashing.block_size, {a.engine_id: a.matched_blocks for a in answers if a.hashing == hashing}
        )

    async def _learn(self, pools: Sequence[str]) -> BlockHashing | None:
        answers = await self.engines.index_matches(_ANY_CHAIN, pools)
        self._hashing = _hashing(answers or [])
        if self._hashing is None:
            self._idle()
        return self._hashing

    def _idle(self) -> None:
        self._idle_until = self._clock() + self.retry_interval


def _hashing(answers: Sequence[PrefixMatch]) -> BlockHashing | None:
    """The hashing most indexed engines announced that a router can compute with."""
    counts: dict[BlockHashing, int] = {}
    for answer in answers:
        if computable(answer.hashing):
            counts[answer.hashing] = counts.get(answer.hashing, 0) + 1
    return max(counts, key=counts.__getitem__, default=None)
