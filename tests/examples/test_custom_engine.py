"""examples/custom_engine runs as documented: real `kv-rendezvous serve`, engines in their own processes, NIXL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl")
pytest.importorskip("torch")

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("auth", [[], ["--auth"]], ids=["open", "auth"])
def test_the_custom_engine_example_verifies_bytes_an_abort_and_a_killed_prefill(auth: list[str]) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "examples.custom_engine", "--requests", "20", *auth],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert "ok    20 requests: every byte of their KV landed in decode's blocks" in lines
    assert "ok    decode abort: decode told REQUESTED, prefill freed its blocks" in lines
    assert "ok    decode abort: both pools whole" in lines
    assert any(line.startswith("ok    prefill killed: decode told PEER_LOST after") for line in lines)
    assert "ok    prefill killed: decode's pool whole" in lines
    assert not any(line.startswith("FAILED") for line in lines)
    # With tokens and required bindings: the signed requests above went through, an unsigned one does not.
    unsigned = "ok    unsigned request: target and claim refused BINDING_REQUIRED"
    assert (unsigned in lines) == bool(auth)
