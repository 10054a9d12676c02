"""examples/local_1p1d.sh stops what it started: a stand-in for vLLM (its `PY`) that exits, or that a SIGTERM to
the script must stop. The real 1P1D needs vLLM and minutes of CPU; what is checked here is the script's own
process handling, with the real `kv-rendezvous serve` it starts beside the engines."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_fixtures import free_port

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "local_1p1d.sh"


def stand_in(tmp_path: Path, body: str) -> dict[str, str]:
    """The script's environment with `PY` a stand-in engine that notes its pid in tmp_path/pids, then runs body;
    free loopback ports and its logs in tmp_path."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho $$ >> "{tmp_path}/pids"\n{body}\n', encoding="utf-8")
    python.chmod(0o755)
    ports = {name: str(free_port()) for name in ("RENDEZVOUS_PORT", "PREFILL_PORT", "DECODE_PORT", "ROUTER_PORT")}
    return {**os.environ, **ports, "PY": str(python), "LOG_DIR": str(tmp_path)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def local_1p1d(env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """The script in a session of its own; whatever it leaves there is killed on the way out."""
    script = subprocess.Popen(["bash", SCRIPT], env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        yield script
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)
        script.wait()


def test_an_engine_that_exits_before_it_serves_stops_the_script(tmp_path: Path) -> None:
    env = stand_in(tmp_path, "exit 3")
    with local_1p1d(env) as script:
        _, stderr = script.communicate(timeout=90)
        assert script.returncode == 1, stderr
        assert f"the engine on port {env['PREFILL_PORT']} exited: {tmp_path}/kv-rendezvous-prefill.log" in stderr


def test_sigterm_stops_the_engines(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    with local_1p1d(stand_in(tmp_path, "exec sleep 600")) as script:
        while len(pids_file.read_text().split() if pids_file.exists() else ()) < 2:  # both engines started
            assert script.poll() is None, script.stderr.read() if script.stderr else ""
            time.sleep(0.05)
        engines = [int(pid) for pid in pids_file.read_text().split()]
        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=60) != 0
        assert [pid for pid in engines if alive(pid)] == [], "engines left running after the script ended"
