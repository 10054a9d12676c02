"""The release artifacts: `python -m build` makes an sdist and, from it, a wheel that installs into a clean venv
and serves (how they are built and installed: tests/wheels.py)."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import rendezvous
from tests.wheels import REPO, build, export_working_tree, isolated_env, run, wheel_venv

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
    assert {"rendezvous/py.typed", "rendezvous/clients/py.typed", "rendezvous/v1/rendezvous_pb2.pyi"} <= names
    assert not any(n.startswith("tests/") for n in names)


def test_the_wheel_installs_one_import_name(dist: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (top_level,) = (n for n in names if n.endswith(".dist-info/top_level.txt"))
        declared = archive.read(top_level).decode().split()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"rendezvous"}
    assert declared == ["rendezvous"]
    # Every module of the SDK (folder clients/) and the connector (connector/) is in it, under rendezvous/.
    for folder in ("clients", "connector"):
        for module in (REPO / folder).rglob("*.py"):
            if (module.parent / "__init__.py").exists():
                assert "rendezvous/" + module.relative_to(REPO).as_posix() in names


def test_the_sdist_holds_the_sdk_and_connector_as_plain_files(dist: Path) -> None:
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        members = {m.name.split("/", 1)[1]: m for m in archive.getmembers() if "/" in m.name}
    assert members["rendezvous/clients/__init__.py"].isfile()
    assert members["rendezvous/connector/rendezvous_connector.py"].isfile()
    assert not [name for name, m in members.items() if m.issym() or m.islnk()]


def test_the_installed_wheel_imports_itself_and_states_its_version(venv: Path) -> None:
    found = run(venv / "bin" / "python", "-c", "import rendezvous; print(rendezvous.__file__)", cwd=venv).strip()
    assert Path(found).is_relative_to(venv)
    code = "import rendezvous.clients as c, rendezvous.connector as v; print(c.__file__, v.__file__)"
    assert all(Path(f).is_relative_to(venv) for f in run(venv / "bin" / "python", "-c", code, cwd=venv).split())
    absent = "import importlib.util as u; print(u.find_spec('clients'), u.find_spec('connector'))"
    assert run(venv / "bin" / "python", "-c", absent, cwd=venv).split() == ["None", "None"]
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
