"""A real NIXL WRITE across a netlab link: the project's endpoint in the prefill namespace writes every block into
one in the decode namespace over UCX TCP on the tbf-shaped veth pair, and the bytes that land are the bytes sent."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from netlab import Lab, Role, down, up, why_not

pytest.importorskip("nixl")

pytestmark = [pytest.mark.netns, pytest.mark.nixl]
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120.0
"""Only a failing test waits this long: importing NIXL and registering memory take seconds on a loaded machine."""


@pytest.fixture
def lab() -> Iterator[Lab]:
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    made = up("5gbit")
    try:
        yield made
    finally:
        down(made.id)


def peer(lab: Lab, role: Role, side: str) -> subprocess.Popen[str]:
    """`tests/benchmarks/link_peer.py side` in `role`'s namespace, its stdin and stdout piped."""
    argv = [*lab.exec_argv(role), sys.executable, "-m", "tests.benchmarks.link_peer", side]
    return subprocess.Popen(argv, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_write_crosses_the_shaped_link_byte_for_byte(lab: Lab) -> None:
    with peer(lab, "decode", "consumer") as consumer, peer(lab, "prefill", "producer") as producer:
        try:
            assert consumer.stdout is not None and producer.stdin is not None and producer.stdout is not None
            agent = consumer.stdout.readline()
            assert json.loads(agent)["name"] == "link-consumer"
            before = lab.sent_bytes("prefill")
            producer.stdin.write(agent)
            producer.stdin.flush()
            written = json.loads(producer.stdout.readline())
            landed = json.loads(consumer.stdout.readline())
            assert written["status"] == "DONE"
            assert landed == {"notifications": ["across-the-link:1"], "equal": True}
            assert lab.sent_bytes("prefill") - before >= written["bytes"]  # the bytes went through the shaped end
            assert producer.wait(TIMEOUT_S) == 0 and consumer.wait(TIMEOUT_S) == 0
        finally:
            producer.kill()
            consumer.kill()
