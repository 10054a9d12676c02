"""Tensor-parallel vLLM engines (--tensor-parallel-size 2; the tiny model's 2 KV heads split one per rank).

`make test` runs this directory in a pytest session of its own, after the rest: on 2 cores, TP workers spinning
in CPU all-reduces next to the other modules' engines starved the rendezvous and the connectors' lease renewals.
Its modules start their TP engines as module fixtures, so no more than one module's run at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rendezvous.clients.testing import TestServer
from rendezvous.connector.launch import Engine, connector_config, free_port, start_engine
from tests.vllm.conftest import RENEWAL_TIMEOUT_S, WARM_UP_TIMEOUT_S

TP2 = ["--tensor-parallel-size", "2"]
LONG = {"lease_ttl": 300, "transfer_timeout": 300, "call_timeout": 60}
"""Leases, transfer and call timeouts of this session's engines: TP workers spinning in CPU all-reduces on 2 cores
can starve a process (the rendezvous in pytest's, an engine's connector) for half a minute; that must make a test
slow, not make an engine look lost or a claim fail (its transfer would abort, rightly)."""
TP_START_TIMEOUT_S = 420.0
TP_TEST_TIMEOUT_S = TP_START_TIMEOUT_S + WARM_UP_TIMEOUT_S + RENEWAL_TIMEOUT_S + 300
"""A test's pytest timeout: above what its fixture's own bounded waits add up to, so that a slow start fails
with the wait's own message (and the engines' logs) rather than pytest-timeout's."""


@pytest.fixture(scope="session")
def engine_session_config() -> dict[str, Any]:
    return LONG


def start_tp_engine(name: str, role: str, model: Path, rendezvous: TestServer, logs: Path, **extra: Any) -> Engine:
    """A TP 2 engine in pool `name` (not yet healthy); `extra` goes to its connector config."""
    port = free_port()
    config = connector_config(role, rendezvous.address, name, port, **extra)
    return start_engine(name, model, logs, port, config, extra_args=TP2)
