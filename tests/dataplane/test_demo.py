"""`kv-rendezvous demo` end to end: a small run verifies every transfer byte for byte."""

from __future__ import annotations

import argparse
import re

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
    if mode != "pull":
        # Stamped in two processes: a figure from the producer's view of its WRITE to the consumer's result was < 0.
        arrived = re.search(r"assigned/ready -> arrived +mean +(\S+) ms +p50 +(\S+) +p99 +(\S+)", out)
        assert arrived is not None, out
        assert all(float(v) >= 0 for v in arrived.groups()), arrived.group(0)
