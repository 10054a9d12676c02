"""`kv-rendezvous serve` with an address it cannot listen on: one line naming the flag, exit 2, nothing left
behind; never a traceback, nor a server on another port."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

SERVE = [sys.executable, "-m", "rendezvous.cli", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off"]


@pytest.fixture
def busy() -> Iterator[str]:
    """An address another socket listens on."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield f"127.0.0.1:{held.getsockname()[1]}"


def refused(*flags: str) -> str:
    """serve's stderr, once it exited 2 without serving; a serve that started fails the test (and is stopped)."""
    with subprocess.Popen(
        [*SERVE, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        started = proc.stdout.readline()  # "" once it exited; its banner once it serves
        if started:
            proc.terminate()
            proc.communicate()
            pytest.fail(f"serve started: {started}")
        err = proc.stderr.read()
        assert proc.wait() == 2, err
    lines = [line for line in err.splitlines() if line.startswith("kv-rendezvous")]
    assert "Traceback" not in err and "Exception ignored" not in err and len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("flag", ["--listen", "--metrics-listen", "--health-listen"])
def test_an_address_in_use_is_named_with_its_flag(flag: str, busy: str) -> None:
    assert refused(flag, busy).startswith(f"kv-rendezvous: {flag} {busy}: ")


@pytest.mark.parametrize("flag", ["--listen", "--metrics-listen", "--health-listen"])
@pytest.mark.parametrize("address", ["garbage", "127.0.0.1:99999", "127.0.0.1:-1"])
def test_an_address_that_is_not_host_port_is_named_with_its_flag(flag: str, address: str) -> None:
    # gRPC took 127.0.0.1:99999 as port 34463 (99999 - 65536) and served there.
    assert refused(flag, address) == f"kv-rendezvous: {flag} {address}: not host:port with a port in 0..65535"
