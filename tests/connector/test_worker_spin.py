"""connector/worker_spin: engines started by rendezvous.connector.launch get vLLM's shared-memory readers' busy loop
shortened to KV_RENDEZVOUS_WORKER_SPIN_MS and their sleep sliced to it; without the variable vLLM's own 1 s and
5 s stand (real vLLM, in a fresh interpreter started as the launcher starts an engine)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from rendezvous.connector.launch import REPO, WORKER_SPIN_ENV, WORKER_SPIN_HOOK

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

_READER_SPIN = """
import time
import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path
context = zmq.Context()
reader = SpinCondition(is_reader=True, context=context, notify_address=get_open_zmq_ipc_path())
reader.last_read = 0.0  # long ago: the next wait sleeps on the socket
started = time.monotonic()
reader.wait(timeout_ms=3000)  # nothing is written: returns at the end of its slice, or after 3 s
print(reader.busy_loop_s, time.monotonic() - started)
"""


def _reader_spin(spin_ms: str | None) -> tuple[float, float]:
    """A reader's busy loop (s), and how long (s) a wait with nothing written slept."""
    env = {k: v for k, v in os.environ.items() if k != WORKER_SPIN_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER_SPIN_HOOK), str(REPO)])
    if spin_ms is not None:
        env[WORKER_SPIN_ENV] = spin_ms
    done = subprocess.run(
        [sys.executable, "-c", _READER_SPIN], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    spin, slept = done.stdout.strip().splitlines()[-1].split()
    return float(spin), float(slept)


def test_the_readers_spin_and_sleep_are_what_the_variable_says() -> None:
    spin, slept = _reader_spin("2")
    assert spin == pytest.approx(0.002) and slept < 1.5  # a 2 ms slice, not the 3 s asked
    for unset in ("", None):  # vLLM's own: 1 s of spinning, then the whole wait asked
        spin, slept = _reader_spin(unset)
        assert spin == 1.0 and slept >= 2.9
