"""clients/cpp: a C++ client generated from proto/ (with the vendored google/rpc protos) runs the protocol against a
real `kv-rendezvous serve`: both roles, the push lifecycle, ErrorInfo reasons, Watch, a layout mismatch, a lapsed
lease, a connection that drops and one that goes silent: engines talk through a loopback TCP proxy that the test
cuts (and refuses new connections) or freezes (forwards nothing, closes nothing) when the client asks, then lets
through again. The server keeps EVENTS_KEPT events per engine, so the client can overrun its log while cut off and
see a resync. Given two replicas on one Redis, the client goes on on the second when the first is stopped.

The build is cached in clients/cpp/build (CMake rebuilds what changed). Without the toolchain (Debian: cmake g++
protobuf-compiler protobuf-compiler-grpc libgrpc++-dev, as `.ci/run` installs) the test skips, except under CI=1,
where it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path

import pytest

from rendezvous.v1 import rendezvous_pb2
from tests.ci import ci
from tests.clients.conftest import TcpProxy
from tests.redis_fixtures import fresh_prefix, redis_url, with_prefix
from tests.replicas.harness import Replica, two_replicas

__all__ = ["redis_url"]  # the session's Redis, a fixture

pytestmark = pytest.mark.timeout(600)

SOURCE = Path(__file__).resolve().parents[2] / "clients" / "cpp"
BUILD = SOURCE / "build"
TOOLS = ("cmake", "g++", "protoc", "grpc_cpp_plugin")
APT = ("cmake", "g++", "protobuf-compiler", "protobuf-compiler-grpc", "libgrpc++-dev")
EVENTS_KEPT = 4
KEEPALIVE = ("--keepalive", "5000,2000")
"""The client's HTTP/2 keepalive pings (time, timeout in ms): a ping after 5 s without a byte from the server, the
most often the server takes one while it sends nothing (its min_ping_interval_without_data: more often, it closes the
connection with GOAWAY too_many_pings); the silent-connection step's lease is four times time + timeout."""
DROP = ("proxy: ", "ok connection dropped", "ok resync", "ok silent connection")


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
    """A real `kv-rendezvous serve` on a free loopback port, keeping EVENTS_KEPT events per engine."""
    command = [sys.executable, "-m", "rendezvous.cli", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off"]
    command += ["--max-events-per-engine", str(EVENTS_KEPT)]
    service = subprocess.Popen([*command, "--drain", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert service.stdout is not None
        yield service.stdout.readline().split(" serving on ")[1].split()[0]
    finally:
        service.terminate()
        service.wait()


async def run(
    client: Path, args: Sequence[str], act: Callable[[str], Awaitable[bool]], stderr: Path
) -> tuple[int, list[str]]:
    """Runs the client with args, doing what it asks: `act(line)` does it and says whether the line was a request,
    which is then answered with the same line; returns the client's exit status and output."""
    with stderr.open("w") as errors:
        run = await asyncio.create_subprocess_exec(
            client, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=errors
        )
    assert run.stdin is not None and run.stdout is not None
    lines = []
    async for raw in run.stdout:
        line = raw.decode().rstrip("\n")
        lines.append(line)
        if await act(line):
            with contextlib.suppress(ConnectionError):  # a client that failed meanwhile has exited
                run.stdin.write(raw)
                await run.stdin.drain()
    return await run.wait(), lines


def acting_on(proxy: TcpProxy) -> Callable[[str], Awaitable[bool]]:
    """What the client asks of its proxy: "proxy: cut" (every connection closed, new ones refused), "proxy: restore"
    (let through again), "proxy: freeze" (nothing forwarded, nothing closed) and "proxy: thaw" (new connections go
    through)."""

    async def act(line: str) -> bool:
        if line == "proxy: cut":
            proxy.refuse(True)
            proxy.cut()
        elif line == "proxy: restore":
            proxy.refuse(False)
        elif line == "proxy: freeze":
            proxy.freeze()
        elif line == "proxy: thaw":
            proxy.thaw()
        else:
            return False
        return True

    return act


async def test_the_cpp_client_runs_the_protocol_against_a_real_server(
    client: Path, address: str, tmp_path: Path
) -> None:
    proxy = TcpProxy(int(address.rsplit(":", 1)[1]))
    await proxy.start()
    try:
        args = (address, proxy.address, str(EVENTS_KEPT), *KEEPALIVE)
        returncode, lines = await asyncio.wait_for(run(client, args, acting_on(proxy), tmp_path / "stderr"), 300)
    finally:
        await proxy.close()
    stderr = (tmp_path / "stderr").read_text()
    assert returncode == 0, "\n".join(lines) + stderr
    assert "too_many_pings" not in stderr, "the server took the client's keepalive pings for abuse"
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
    drop = [line.split(":")[0 if line.startswith("ok") else 1].strip() for line in lines if line.startswith(DROP)]
    assert drop == [
        *("cut", "restore", "ok connection dropped", "cut", "restore", "ok resync"),
        *("freeze", "thaw", "ok silent connection"),
    ], lines
    assert any(line.startswith(f"ok resync: {EVENTS_KEPT + 1} commits made while away") for line in lines)
    assert proxy.accepted >= 4, "a connection through the proxy before the cuts, after each and after the freeze"
    assert lines[-1] == "ok deregistered"


@pytest.mark.redis
async def test_the_cpp_client_goes_on_on_another_replica(client: Path, redis_url: str, tmp_path: Path) -> None:
    """Two replicas on one Redis, the client's channel naming both (gRPC's ipv4:A,B target): the walkthrough runs
    on the first, which is stopped (SIGTERM) when the client asks; its KeepAlive and Watch streams go on on the other,
    the same incarnations renewed, the Watch resumed with no event lost or repeated (the client checks each)."""
    with two_replicas(with_prefix(redis_url, fresh_prefix())) as (a, b):
        replicas = {f"ipv4:{replica.address}": replica for replica in (a, b)}
        stopped: list[Replica] = []

        async def act(line: str) -> bool:
            if not line.startswith("replica: stop "):
                return False
            stopped.append(replicas[line.removeprefix("replica: stop ")])
            await asyncio.to_thread(stopped[-1].terminate)
            return True

        args = (f"ipv4:{a.address},{b.address}", *KEEPALIVE)
        returncode, lines = await asyncio.wait_for(run(client, args, act, tmp_path / "stderr"), 300)
        stderr = (tmp_path / "stderr").read_text()
        assert returncode == 0, "\n".join(lines) + stderr
        assert "too_many_pings" not in stderr, "the server took the client's keepalive pings for abuse"
        assert stopped == [a], "one stop asked, of the replica talked to (pick_first: the first address)"
        assert b.alive()
    assert any(line.startswith("ok replica stopped: ipv4:" + a.address) for line in lines), lines
    assert any(f" on ipv4:{b.address}, a transfer run through it" in line for line in lines), lines
    assert lines[-1] == "ok deregistered"


def test_the_cpp_client_states_every_layout_field() -> None:
    """docs/engines.md asks an engine to state every KvLayout field, data_plane_version included (left 0 it is 1,
    which no SDK producer pairs with); the example it points to does. Reads the source: needs no toolchain."""
    source = (SOURCE / "engine.h").read_text(encoding="utf-8")  # Engine::Register
    fields = [field.name for field in rendezvous_pb2.KvLayout.DESCRIPTOR.fields]
    unstated = [name for name in fields if f"layout->set_{name}(" not in source]
    assert not unstated, f"engine.h leaves these KvLayout fields unstated: {unstated}"
