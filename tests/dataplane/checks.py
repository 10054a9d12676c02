"""Test-side helpers: disjoint random block ids and byte-exact checks of a consumer's whole KV pool."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from tests.dataplane.worker import SENTINEL, WorkerProcess, pattern

_ids = itertools.count()


def transfer_id(prefix: str = "t") -> str:
    """A transfer id no other test uses."""
    return f"{prefix}-{next(_ids)}"


@dataclass(frozen=True)
class Landed:
    """`dst` holds the last len(dst) of the `num_src` pattern blocks of `seed`."""

    seed: int
    num_src: int
    dst: list[int]


def chunks(rng: np.random.Generator, num_blocks: int, sizes: list[int]) -> list[list[int]]:
    """Disjoint lists of random block ids (a permutation split up), one per size."""
    perm = [int(b) for b in rng.permutation(num_blocks)]
    bounds = np.cumsum([0, *sizes])
    assert bounds[-1] <= num_blocks
    return [perm[a:b] for a, b in itertools.pairwise(bounds)]


def assert_pool(consumer: WorkerProcess, landed: list[Landed]) -> None:
    """Every byte of the consumer's pool: the landed blocks hold their source bytes, the rest the sentinel."""
    memory = consumer.call("memory")
    for r, region in enumerate(memory):
        expected = np.full_like(region, SENTINEL)
        for item in landed:
            rows = pattern(item.seed, r, item.num_src, region.shape[1])
            expected[item.dst] = rows[item.num_src - len(item.dst) :]
        np.testing.assert_array_equal(region, expected, err_msg=f"region {r}")


def reset_pool(consumer: WorkerProcess) -> None:
    """Back to the sentinel everywhere, for the next test."""
    consumer.call("reset", list(range(consumer.spec.num_blocks)))
