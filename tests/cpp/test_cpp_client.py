"""clients/cpp: a C++ client generated from proto/ (with the vendored google/rpc protos) runs the protocol against a
real `kv-rendezvous serve`: both roles, the push lifecycle, ErrorInfo reasons, Watch, a layout mismatch, a lapsed
lease.

The build is cached in clients/cpp/build (CMake rebuilds what changed). Without the toolchain (Debian: cmake g++
protobuf-compiler protobuf-compiler-grpc libgrpc++-dev, as `.ci/run` installs) the test skips, except under CI=1,
where it fails.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rendezvous.v1 import rendezvous_pb2
from tests.ci import ci

pytestmark = pytest.mark.timeout(600)

SOURCE = Path(__file__).resolve().parents[2] / "clients" / "cpp"
BUILD = SOURCE / "build"
TOOLS = ("cmake", "g++", "protoc", "grpc_cpp_plugin")
APT = ("cmake", "g++", "protobuf-compiler", "protobuf-compiler-grpc", "libgrpc++-dev")


@pytest.fixture(scope="module")
def client() -> Path:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        why = f"the C++ toolchain lacks {', '.join(missing)} (apt-get install {' '.join(APT)})"
        if ci():
            pytest.fail(why)
        pytest.skip(why)
    configure = subprocess.run(["cmake", "-S", SOURCE, "-B", BUILD], capture_output=True, text=True)
    if configure.returncode != 0 and not ci() and "gRPC" in configure.stdout + configure.stderr:
        pytest.skip(f"gRPC C++ is not installed (apt-get install {' '.join(APT)})")
    assert configure.returncode == 0, configure.stdout + configure.stderr
    build = subprocess.run(["cmake", "--build", BUILD, "-j2"], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    return BUILD / "rendezvous_client"


@pytest.fixture
def address() -> Iterator[str]:
    """A real `kv-rendezvous serve` on a free loopback port."""
    command = [sys.executable, "-m", "rendezvous.cli", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off"]
    service = subprocess.Popen([*command, "--drain", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert service.stdout is not None
        yield service.stdout.readline().split(" serving on ")[1].split()[0]
    finally:
        service.terminate()
        service.wait()


def test_the_cpp_client_runs_the_protocol_against_a_real_server(client: Path, address: str) -> None:
    run = subprocess.run([client, address], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("ok registered a consumer")
    assert (
        "ok push lifecycle: TARGETED, MATCHED, TRANSFER_ASSIGNED(1), COMMITTED, TRANSFER_COMMITTED, RELEASED" in lines
    )
    assert "ok item refused: OUT_OF_RANGE / BLOCK_ID_OUT_OF_RANGE" in lines
    assert "ok call refused: FAILED_PRECONDITION / STALE_INCARNATION" in lines
    assert (
        "ok layout mismatch: TRANSFER_ABORTED(LAYOUT_MISMATCH): dtype differs: producer 'float16', consumer 'bfloat16'"
        in lines
    )
    assert any(
        line.startswith("ok lease expiry: producer told PEER_LOST, KeepAlive refused LEASE_EXPIRED") for line in lines
    )
    assert lines[-1] == "ok deregistered"


def test_the_cpp_client_states_every_layout_field() -> None:
    """docs/engines.md asks an engine to state every KvLayout field, data_plane_version included (left 0 it is 1,
    which no SDK producer pairs with); the example it points to does. Reads the source: needs no toolchain."""
    source = (SOURCE / "rendezvous_client.cc").read_text(encoding="utf-8")
    fields = [field.name for field in rendezvous_pb2.KvLayout.DESCRIPTOR.fields]
    unstated = [name for name in fields if f"layout->set_{name}(" not in source]
    assert not unstated, f"rendezvous_client.cc leaves these KvLayout fields unstated: {unstated}"
