"""scripts/gpu_check.sh: skips cleanly without a GPU; its helper's flow passes on DRAM and loads no SDK."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_without_a_gpu_the_check_says_so_and_succeeds() -> None:
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("no GPU: skipping")


def test_the_helper_loads_the_data_plane_without_the_sdk_or_grpc() -> None:
    code = (
        "import runpy, sys\n"
        "helper = runpy.run_path('scripts/gpu_check.py')\n"
        "helper['load_data_plane']()\n"
        "import rendezvous.clients.nixl.writer, rendezvous.clients.nixl.receiver\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'google', 'rendezvous')))\n"
    )
    pytest.importorskip("nixl")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    loaded = ast.literal_eval(done.stdout)
    assert not [m for m in loaded if m.split(".")[0] in ("grpc", "google")]
    assert "rendezvous.clients._session" not in loaded and "rendezvous.clients.nixl.producer" not in loaded
    assert "rendezvous.clients.nixl.writer" in loaded  # loaded, and under its one name


@pytest.mark.nixl
@pytest.mark.timeout(120)
def test_the_helper_moves_and_checks_every_byte_on_dram() -> None:
    pytest.importorskip("nixl")
    pytest.importorskip("torch")
    env = {**os.environ, "UCX_TLS": "shm,tcp", "UCX_NET_DEVICES": "lo"}
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--reps", "1"],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=REPO,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if "->" in line and ":" in line]
    assert [line.split(":")[0] for line in lines] == ["tp2->tp2", "pp2->tp2", "tp2->tp2 layer-wise"]
    assert all(": OK" in line for line in lines)
