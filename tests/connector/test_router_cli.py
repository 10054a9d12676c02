"""`kv-rendezvous router` given wrong flags and environment variables: one line naming the flag (or variable) and
the value, exit 2, never a traceback and never a router that starts anyway."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from rendezvous.connector import router
from tests.service.test_cli_listen import busy

__all__ = ["busy"]

ROUTER = ["--address", "127.0.0.1:50051", "--listen", "127.0.0.1:0"]


@pytest.fixture(autouse=True)
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A router that gets as far as serving fails the test instead of serving until it is stopped."""

    def run_app(app: Any, *, sock: socket.socket, **kwargs: Any) -> None:
        app.close()
        sock.close()
        raise AssertionError("the router started")

    monkeypatch.setattr(web, "run_app", run_app)
    monkeypatch.delenv("KV_RENDEZVOUS_BINDING_KEY_FILE", raising=False)
    monkeypatch.delenv("KV_RENDEZVOUS_TRACING", raising=False)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line of stderr the router refused its arguments with (exit 2)."""
    with pytest.raises(SystemExit) as exited:
        router.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("kv-rendezvous router: error: "), err
    return err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--listen", "127.0.0.1:99999"),  # an OverflowError traceback from bind()
        ("--listen", "127.0.0.1:-1"),
        ("--listen", "garbage"),  # a ValueError traceback from int()
        ("--address", ","),  # a ValueError traceback from ClientConfig
        ("--address", "garbage"),  # served, every request then failed
        ("--address", "127.0.0.1:0"),
        ("--timeout", "nan"),  # these started a router that misbehaved later
        ("--timeout", "0"),
        ("--timeout", "-1"),
        ("--connect-timeout", "0"),
        ("--connect-timeout", "-1"),
        ("--connect-timeout", "inf"),
        ("--refresh-interval", "-1"),
        ("--refresh-interval", "nan"),
        ("--queue-timeout", "nan"),
        ("--queue-timeout", "-1"),  # the rest ended in a ValueError traceback at start
        ("--credit-ttl", "nan"),
        ("--credit-ttl", "-1"),
        ("--rendezvous-timeout", "nan"),
        ("--rendezvous-timeout", "inf"),
        ("--rendezvous-timeout", "0"),
        ("--rendezvous-retry-after", "inf"),
        ("--rendezvous-retry-after", "0"),
        ("--degraded-max-age", "-1"),
        ("--degraded-max-age", "nan"),
        ("--binding-ttl", "-1"),
        ("--binding-ttl", "inf"),
        ("--load-weight", "nan"),
        ("--load-weight", "-1"),
        ("--prefix-block", "0"),
        ("--local-prefill-below", "-1"),
        ("--local-prefill-when-busy", "-1"),
        ("--max-queued", "-1"),
        ("--max-body-bytes", "0"),
        ("--max-body-bytes", "abc"),
        ("--prefill-pool", ""),  # an empty pool
        ("--decode-pool", " "),
    ],
)
def test_the_router_refuses_a_value_out_of_its_flags_range(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused([*ROUTER, f"{flag}={value}"], capsys)
    assert f"argument {flag}: " in err and repr(value) in err


def test_an_address_in_use_is_named_with_its_flag(busy: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["--address", "127.0.0.1:50051", "--listen", busy], capsys)
    assert err.startswith(f"kv-rendezvous router: error: --listen {busy}: "), err


def test_the_old_address_flag_checks_its_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert "argument --rendezvous: 'garbage'" in refused(["--rendezvous", "garbage"], capsys)


@pytest.mark.parametrize(
    ("content", "says"),
    [(None, "No such file or directory"), ("short\n", "the key on line 1 is 5 bytes, shorter than 32")],
)
def test_a_binding_key_file_it_cannot_use_is_named(
    content: str | None, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys"
    if content is not None:
        path.write_text(content)
    assert refused([*ROUTER, "--binding-key-file", str(path)], capsys).startswith(
        f"kv-rendezvous router: error: --binding-key-file {path}: {says}"
    )


def test_a_binding_key_file_from_the_environment_is_named_by_its_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KV_RENDEZVOUS_BINDING_KEY_FILE", str(tmp_path / "missing"))
    assert "KV_RENDEZVOUS_BINDING_KEY_FILE" in refused(ROUTER, capsys)


def test_a_tracing_variable_that_is_no_boolean_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # It turned tracing off silently; serve refuses it.
    monkeypatch.setenv("KV_RENDEZVOUS_TRACING", "maybe")
    assert "KV_RENDEZVOUS_TRACING='maybe'" in refused(ROUTER, capsys)


def test_a_tokenizer_it_cannot_load_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def tokenizer(name: str) -> Any:
        raise OSError(f"{name} is not a tokenizer\nmore lines of advice")

    monkeypatch.setattr(router, "_tokenizer", tokenizer)
    err = refused([*ROUTER, "--tokenizer", "/nonexistent/tok"], capsys)
    assert err.startswith("kv-rendezvous router: error: --tokenizer /nonexistent/tok: /nonexistent/tok is not"), err


def test_good_flags_reach_the_start(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*ROUTER, "--address", "127.0.0.1:1,dns:///rendezvous:50051", "--queue-timeout", "0", "--max-queued", "0"]
    with pytest.raises(AssertionError, match="the router started"):
        router.main(argv)
