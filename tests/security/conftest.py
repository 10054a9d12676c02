"""Certificates made per test session, and helpers to start secured servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.security.certs import CertificateAuthority, Pair


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
