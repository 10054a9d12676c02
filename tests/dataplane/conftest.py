"""Data-plane tests: producer and consumer agents in separate spawned processes, real NIXL over UCX on
loopback (tests/conftest.py pins UCX_TLS and UCX_NET_DEVICES; children inherit them), and a real rendezvous
server in this process. Workers are shared by the package: spawning one and importing NIXL costs seconds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("nixl")
pytest.importorskip("torch")

from rendezvous.clients.testing import FakeClock, TestServer
from rendezvous.core.limits import Timeouts
from tests.dataplane.worker import Spec, WorkerProcess

LEASE_TTL = 2.0
"""The lease of the workers that tests kill: how fast the service notices a dead engine."""


@pytest.fixture(scope="package")
def clock() -> FakeClock:
    """The server's time: a killed engine's lease lapses when a test moves it (and sweeps), not after real seconds
    that a loaded machine stretches. The workers renew on real time and hold the default 10 s lease, which the
    kills' advances (LEASE_TTL each, tests/dataplane/test_failures.py) never add up to."""
    return FakeClock()


@pytest.fixture(scope="package")
def server(clock: FakeClock) -> Iterator[TestServer]:
    with TestServer(clock, timeouts=Timeouts(min_lease_ttl=0.5)) as s:
        yield s


@pytest.fixture(scope="package")
def producer(server: TestServer) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(Spec("producer", server.address, "prefill-0"))
    yield worker
    worker.close()


@pytest.fixture(scope="package")
def consumer(server: TestServer) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(Spec("consumer", server.address, "decode-0"))
    yield worker
    worker.close()
