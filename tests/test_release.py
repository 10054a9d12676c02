"""The release artifacts: `python -m build` makes an sdist and, from it, a wheel that installs into a clean venv
and serves. The build runs without isolation (the setuptools of this environment, no index needed); the clean
venv gets the wheel with --no-deps and sees this environment's packages only as a plain path (no editable
installs), so what it imports of kv-rendezvous is the wheel's."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import rendezvous

pytest.importorskip("build")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 60.0
_SERVING = re.compile(r"serving on (\S+)")


def _isolated() -> dict[str, str]:
    """The environment for the clean venv's commands: nothing on PYTHONPATH (run them outside the repository)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONUNBUFFERED": "1"}


def _run(*args: str | Path, cwd: Path | None = None) -> str:
    env = None if cwd is None else _isolated()
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and wheel of the working tree (its tracked and unignored files, copied: the build writes there)."""
    root = tmp_path_factory.mktemp("release")
    source = root / "source"
    files = _run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=REPO).split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes(src.read_bytes())
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", root / "dist", source)
    return root / "dist"


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding only the wheel, this environment's site-packages visible after its own."""
    path = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", path)
    python = path / "bin" / "python"
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=path).strip()
    (Path(site) / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (wheel,) = dist.glob("*.whl")
    _run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel, cwd=path)
    return path


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
    found = _run(venv / "bin" / "python", "-c", "import rendezvous; print(rendezvous.__file__)", cwd=venv).strip()
    assert Path(found).is_relative_to(venv)
    assert _run(venv / "bin" / "kv-rendezvous", "--version", cwd=venv).strip() == rendezvous.__version__


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
        env=_isolated(),
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
