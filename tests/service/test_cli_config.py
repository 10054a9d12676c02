"""`kv-rendezvous` given wrong flags and environment variables: one line naming the flag or variable, exit 2,
never a traceback and never a server that starts anyway."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rendezvous.cli import main
from rendezvous.clients.testing import TestServer
from rendezvous.server import RendezvousServer


@pytest.fixture
def server() -> Iterator[TestServer]:
    with TestServer() as srv:
        yield srv


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `serve` that gets as far as starting fails the test instead of serving until it is stopped."""

    async def start(self: RendezvousServer) -> None:
        raise AssertionError("the server started")

    monkeypatch.setattr(RendezvousServer, "start", start)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line of stderr a command refused with exit 2 printed."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    ("variable", "value"),
    [("KV_RENDEZVOUS_MAX_BATCH_ITEMS", "abc"), ("KV_RENDEZVOUS_DRAIN", "soon"), ("KV_RENDEZVOUS_TRACING", "maybe")],
)
def test_a_bad_serve_variable_is_named_by_serve_and_leaves_the_other_commands_alone(
    variable: str,
    value: str,
    server: TestServer,
    no_start: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(variable, value)
    assert main(["status", "--address", server.address]) == 0
    capsys.readouterr()
    err = refused(["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off"], capsys)
    assert f"{variable}={value!r}" in err and "--" + variable.removeprefix("KV_RENDEZVOUS_").lower().replace("_", "-") in err


def test_a_bad_inspection_variable_is_named(
    server: TestServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KV_RENDEZVOUS_TLS", "maybe")
    assert "KV_RENDEZVOUS_TLS='maybe'" in refused(["status", "--address", server.address], capsys)
