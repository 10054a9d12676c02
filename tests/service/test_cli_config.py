"""`kv-rendezvous` given wrong flags and environment variables: one line naming the flag or variable, exit 2,
never a traceback and never a server that starts anyway."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rendezvous.cli import build_parser, main
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
    """The one line of stderr a command refused with exit 2 printed (argparse's refusals exit)."""
    try:
        status = main(argv)
    except SystemExit as exit:
        status = int(exit.code or 0)
    assert status == 2
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
    flag = "--" + variable.removeprefix("KV_RENDEZVOUS_").lower().replace("_", "-")
    assert f"{variable}={value!r}" in err and flag in err


def test_a_bad_inspection_variable_is_named(
    server: TestServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KV_RENDEZVOUS_TLS", "maybe")
    assert "KV_RENDEZVOUS_TLS='maybe'" in refused(["status", "--address", server.address], capsys)


SERVE = ["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off"]


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--drain", "nan"),
        ("--drain", "-1"),
        ("--grace", "inf"),
        ("--sweep-interval", "0"),  # a sweep loop that never waits
        ("--sweep-interval", "-1"),
        ("--max-message-bytes", str(2**31)),  # a traceback from gRPC's channel arguments
        ("--receive-window-bytes", str(2**31)),
        ("--rate-limit", "nan"),
        ("--refusal-rate", "inf"),
        ("--max-streams", "-1"),
        ("--invalid-backoff-hold", "nan"),
        ("--min-token-bytes", "0"),
        ("--default-lease-ttl", "-1"),
        ("--tombstone-ttl", "nan"),
        ("--max-batch-items", "-1"),
        ("--max-list-page", "0"),
        ("--log-level", "chatty"),  # a traceback from logging
        ("--log-format", "xml"),  # silently text
    ],
)
def test_serve_refuses_a_value_out_of_its_flags_range(
    flag: str, value: str, no_start: None, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused([*SERVE, f"{flag}={value}"], capsys)
    assert flag in err and repr(value) in err


def test_serve_refuses_a_variable_out_of_its_flags_range(
    no_start: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KV_RENDEZVOUS_SWEEP_INTERVAL", "0")
    assert "KV_RENDEZVOUS_SWEEP_INTERVAL='0'" in refused(SERVE, capsys)


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        (["--min-lease-ttl", "500"], ("--min-lease-ttl", "--max-lease-ttl")),
        (["--default-lease-ttl", "0.5"], ("--min-lease-ttl", "--default-lease-ttl")),
        (["--default-claim-timeout", "7200"], ("--default-claim-timeout", "--max-timeout")),
    ],
)
def test_serve_refuses_timeouts_that_contradict_each_other(
    argv: list[str], flags: tuple[str, ...], no_start: None, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused([*SERVE, *argv], capsys)
    assert all(flag in err for flag in flags)


def test_log_level_takes_any_case() -> None:
    parsed = build_parser(entry_point_commands=False).parse_args(["serve", "--log-level", "DEBUG"])
    assert parsed.log_level == "debug"


@pytest.mark.parametrize(("flag", "value"), [("--timeout", "-1"), ("--timeout", "nan"), ("--limit", "-5")])
def test_inspection_refuses_a_value_out_of_its_flags_range(
    flag: str, value: str, server: TestServer, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(["transfers", "--address", server.address, flag, value], capsys)
    assert flag in err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--ca", "/nonexistent/ca.pem"], "--ca /nonexistent/ca.pem: No such file or directory"),
        (["--client-cert", "/nonexistent/c.pem", "--client-key", "/nonexistent/k.pem"], "/nonexistent/k.pem"),
        (["--client-cert", "/nonexistent/c.pem"], "--client-cert and --client-key go together"),
    ],
)
def test_inspection_names_a_tls_flag_it_cannot_use(
    flags: list[str], says: str, server: TestServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in refused(["status", "--address", server.address, *flags], capsys)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        # Both said only what was wrong, not which flag: "store URL 'redis://[bad': Invalid IPv6 URL", and
        # "[Errno 2] No such file or directory: '/nonexistent/auth.json'".
        (["--store", "redis://[bad"], "kv-rendezvous: --store redis://[bad: Invalid IPv6 URL"),
        (["--store", "postgres://x"], "kv-rendezvous: --store postgres://x: unknown store: use 'memory'"),
        (["--auth-file", "/nonexistent/auth.json"], "kv-rendezvous: --auth-file /nonexistent/auth.json: No such file"),
        (["--binding-key-file", "/nonexistent/keys"], "kv-rendezvous: --binding-key-file /nonexistent/keys: No such"),
    ],
)
def test_serve_names_the_flag_of_a_store_or_file_it_cannot_use(
    flags: list[str], says: str, no_start: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert refused([*SERVE, *flags], capsys).startswith(says)
