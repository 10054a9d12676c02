"""`kv-rendezvous demo` given wrong flags: one line naming the flag and the value, exit 2, never a traceback and
never a demo that starts its engines anyway."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("numpy")  # the demo's engines fill and check their blocks with numpy

from rendezvous.clients import testing
from rendezvous.clients._cli import run_demo_command
from rendezvous.clients.demo import add_demo_arguments, run_demo


@pytest.fixture(autouse=True)
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A demo that gets as far as starting its rendezvous fails the test instead of running."""

    def enter(self: testing.TestServer) -> testing.TestServer:
        raise AssertionError("the demo started")

    monkeypatch.setattr(testing.TestServer, "__enter__", enter)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line of stderr the demo refused its arguments with (exit 2)."""
    with pytest.raises(SystemExit) as exited:
        run_demo_command(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("kv-rendezvous demo: error: "), err
    return err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--producers", "0"),  # a ZeroDivisionError traceback
        ("--consumers", "0"),  # an IndexError traceback
        ("--block-kib", "0"),  # engines that never started: a hang
        ("--regions", "0"),  # a hang
        ("--concurrency", "0"),  # nothing sent: a minute's wait, then "an engine stopped answering"
        ("--transfers", "-1"),  # "0/0 transfers verified", exit 1
        ("--transfers", "0"),
        ("--min-blocks", "0"),
        ("--pool-blocks", "-3"),
        ("--max-blocks", "x"),
    ],
)
def test_the_demo_refuses_a_value_out_of_its_flags_range(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused([f"{flag}={value}"], capsys)
    assert f"argument {flag}: " in err and repr(value) in err


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        (["--min-blocks", "8", "--max-blocks", "4"], ("--min-blocks (8)", "--max-blocks (4)")),
        (["--max-blocks", "300"], ("--max-blocks (300)", "--pool-blocks (256)")),
        # 32 MiB per region: each engine raised in its own process, the demo waited for reports that never came
        (["--block-kib", "1024"], ("--max-blocks (32)", "--block-kib (1024)", "8 MiB")),
    ],
)
def test_the_demo_refuses_flags_that_do_not_go_together(
    argv: list[str], flags: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(argv, capsys)
    assert all(flag in err for flag in flags), err


def test_run_demo_refuses_them_too(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    assert run_demo(parser.parse_args(["--block-kib", "1024"])) == 2
    assert capsys.readouterr().err.startswith("kv-rendezvous demo: error: --max-blocks (32) x --block-kib (1024)")


def test_good_flags_reach_the_start() -> None:
    with pytest.raises(AssertionError, match="the demo started"):
        run_demo_command(["--block-kib", "256", "--max-blocks", "32", "--transfers", "1"])
