"""NIXL tests: real agents in this process and in a spawned peer process, over UCX on loopback.

tests/conftest.py pins UCX to shm,tcp on `lo` before anything starts UCX; spawned children inherit it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("nixl")
pytest.importorskip("torch")

from tests.nixl.peer import PeerProcess


@pytest.fixture(scope="module")
def peer() -> Iterator[PeerProcess]:
    """One peer process per test module: spawning it and importing NIXL costs seconds on 2 cores."""
    process = PeerProcess()
    yield process
    process.close()
