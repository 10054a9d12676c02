"""`kv-rendezvous demo` end to end: a small run verifies every transfer byte for byte."""

from __future__ import annotations

import argparse

import pytest

from rendezvous.clients.demo import add_demo_arguments, run_demo


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("mode", "engines"), [("push", "2"), ("pull", "1"), ("progressive", "1")])
def test_small_demo_verifies_every_transfer(mode: str, engines: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    small = ["--transfers", "20", "--block-kib", "16", "--pool-blocks", "64", "--max-blocks", "8"]
    args = parser.parse_args([*small, "--mode", mode, "--producers", engines, "--consumers", engines])
    assert run_demo(args) == 0
    out = capsys.readouterr().out
    assert "20/20 transfers verified byte for byte (0 failed)" in out
    assert "MiB/s" in out
