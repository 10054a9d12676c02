"""The release artifacts: `python -m build` makes an sdist and, from it, a wheel that installs into a clean venv
and serves (how they are built and installed: tests/wheels.py)."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import rendezvous
from tests.wheels import build, export_working_tree, isolated_env, run, wheel_venv

pytest.importorskip("build")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

START_TIMEOUT_S = 60.0
_SERVING = re.compile(r"serving on (\S+)")


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and wheel of the working tree."""
    root = tmp_path_factory.mktemp("release")
    return build(export_working_tree(root / "source"), root / "dist")


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding only the wheel, this environment's site-packages visible after its own."""
    (wheel,) = dist.glob("*.whl")
    return wheel_venv(wheel, tmp_path_factory.mktemp("venv"))


def test_the_sdist_and_wheel_carry_the_one_version_and_the_packages_data(dist: Path) -> None:
    version = rendezvous.__version__
    assert sorted(p.name for p in dist.iterdir()) == [
        f"kv_rendezvous-{version}-py3-none-any.whl",
        f"kv_rendezvous-{version}.tar.gz",
    ]
    with zipfile.ZipFile(dist / f"kv_rendezvous-{version}-py3-none-any.whl") as wheel:
        names = set(wheel.namelist())
    assert "rendezvous/store/redis/scripts/commit_transfers.lua" in names
    assert {"rendezvous/py.typed", "clients/py.typed", "rendezvous/v1/rendezvous_pb2.pyi"} <= names
    assert not any(n.startswith("tests/") for n in names)


def test_the_installed_wheel_imports_itself_and_states_its_version(venv: Path) -> None:
    found = run(venv / "bin" / "python", "-c", "import rendezvous; print(rendezvous.__file__)", cwd=venv).strip()
    assert Path(found).is_relative_to(venv)
    assert run(venv / "bin" / "kv-rendezvous", "--version", cwd=venv).strip() == rendezvous.__version__


@pytest.fixture
def served(venv: Path) -> Iterator[str]:
    """`kv-rendezvous serve` of the installed wheel on a free loopback port: its address."""
    args = [venv / "bin" / "kv-rendezvous", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off"]
    process = subprocess.Popen(
        [str(a) for a in (*args, "--drain", "0", "--grace", "1")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=venv,
        env=isolated_env(),
    )
    assert process.stdout is not None
    output = b""
    address = None
    deadline = time.monotonic() + START_TIMEOUT_S
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while address is None and time.monotonic() < deadline and process.poll() is None:
            if selector.select(timeout=0.5):
                output += os.read(process.stdout.fileno(), 4096)
                found = _SERVING.search(output.decode(errors="replace"))
                address = found.group(1) if found else None
    try:
        assert address is not None, f"the installed service did not start:\n{output.decode(errors='replace')}"
        yield address
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_the_installed_wheel_serves(served: str) -> None:
    with grpc.insecure_channel(served) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        answer = health.Check(health_pb2.HealthCheckRequest(), timeout=30, wait_for_ready=True)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
