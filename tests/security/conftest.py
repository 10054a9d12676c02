"""Certificates made per test session, and helpers to start secured servers."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rendezvous.server import RendezvousServer, ServerConfig
from tests.security.certs import CertificateAuthority, Pair


@contextlib.asynccontextmanager
async def serving(**config: Any) -> AsyncIterator[RendezvousServer]:
    """A server on a free port, configured by ServerConfig fields (tls=..., auth_file=...) and its clock=..."""
    clock = config.pop("clock", None)
    server = RendezvousServer(ServerConfig(listen="127.0.0.1:0", grace=0.1, **config), clock)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)


@pytest.fixture
async def channel(server: RendezvousServer) -> AsyncIterator[grpc.aio.Channel]:
    """A plaintext channel to the test module's `server` fixture."""
    async with grpc.aio.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture(scope="session")
def ca() -> CertificateAuthority:
    return CertificateAuthority("rendezvous-test-ca")


@pytest.fixture(scope="session")
def server_pair(ca: CertificateAuthority) -> Pair:
    return ca.issue("kv-rendezvous", server=True)


@pytest.fixture
def server_files(tmp_path: Path, server_pair: Pair) -> tuple[str, str]:
    """The server certificate and key as files (cert path, key path)."""
    return server_pair.write(tmp_path, "server")
