"""connector/worker_spin: engines started by connector.launch get vLLM's shared-memory readers' busy loop
shortened to KV_RENDEZVOUS_WORKER_SPIN_MS; without the variable vLLM's own 1 s stands (real vLLM, in a fresh
interpreter started as the launcher starts an engine)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from connector.launch import REPO, WORKER_SPIN_ENV, WORKER_SPIN_HOOK

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

_READER_SPIN = """
import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path
context = zmq.Context()
reader = SpinCondition(is_reader=True, context=context, notify_address=get_open_zmq_ipc_path())
print(reader.busy_loop_s)
"""


def _reader_spin(spin_ms: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != WORKER_SPIN_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER_SPIN_HOOK), str(REPO)])
    if spin_ms is not None:
        env[WORKER_SPIN_ENV] = spin_ms
    done = subprocess.run(
        [sys.executable, "-c", _READER_SPIN], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


@needs_vllm
def test_the_readers_spin_is_what_the_variable_says() -> None:
    assert _reader_spin("2") == pytest.approx(0.002)
    assert _reader_spin("") == 1.0  # empty: vLLM's own
    assert _reader_spin(None) == 1.0
