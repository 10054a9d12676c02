"""Redis for tests: a Docker container where a Docker engine answers, otherwise a local redis-server.

Fixtures:
    redis_url      one Redis for the session (container or local process); tests isolate themselves
                   with a fresh key prefix (`fresh_prefix`), so nothing needs flushing.
    redis_server   a Redis of the test's own, which it may stop, kill and restart (persistence tests).

Both skip only when neither a Docker engine nor a redis-server binary exists. Local servers listen
on a unix socket in a short temporary directory (no port races), with no persistence unless asked.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
START_TIMEOUT_S = 60.0  # generous: CI machines have 2 cores and may be busy


def docker_available() -> bool:
    """Whether a Docker engine answers (testcontainers fails within a fraction of a second otherwise)."""
    try:
        import docker

        client = docker.from_env(timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def fresh_prefix() -> str:
    """A key namespace no other test uses."""
    return f"t{uuid.uuid4().hex[:12]}"


def with_prefix(url: str, prefix: str) -> str:
    """url with the store's prefix option added."""
    return f"{url}{'&' if '?' in url else '?'}prefix={prefix}"


def wait_until(predicate: object, timeout: float, what: str, interval: float = 0.02) -> None:
    """Poll predicate() until true; fail the test naming `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():  # type: ignore[operator]
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class ControlledRedis(Protocol):
    """A Redis a test may stop and start again."""

    url: str

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def kill(self) -> None: ...
    def close(self) -> None: ...
    def client(self) -> redis.Redis: ...


class LocalRedis:
    """A redis-server process on a unix socket in its own directory.

    `appendonly` turns on AOF with appendfsync everysec. `stop()` sends SHUTDOWN (which fsyncs the
    AOF), `kill()` SIGKILLs it; `start()` runs it again on the same socket and directory.
    """

    def __init__(self, appendonly: bool = False, tcp: bool = False, extra: tuple[str, ...] = ()) -> None:
        assert REDIS_SERVER is not None
        # Short path: unix socket paths are limited to ~107 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="rdv-redis-", dir="/tmp"))
        self.socket = self.dir / "redis.sock"
        self.url = f"unix://{self.socket}"
        self.port = free_port() if tcp else 0
        self.appendonly = appendonly
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert REDIS_SERVER is not None and self.process is None
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--logfile", str(self.dir / "redis.log"),
            *self.extra,
        ]  # fmt: skip
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        wait_until(self._answers, START_TIMEOUT_S, f"redis-server on {self.socket}")

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"redis-server exited with {self.process.returncode}: {log}")
        with self.client() as c:
            return bool(c.ping())

    def client(self) -> redis.Redis:
        """A synchronous client (for arranging and inspecting state)."""
        return redis.Redis(unix_socket_path=str(self.socket), socket_timeout=5, retry=Retry(NoBackoff(), 0))

    def stop(self) -> None:
        """SHUTDOWN: Redis fsyncs the AOF (when on) and exits."""
        if self.process is None:
            return
        with contextlib.suppress(redis.ConnectionError), self.client() as c:
            c.shutdown(nosave=not self.appendonly)
        self._reap()

    def pause(self) -> None:
        """SIGSTOP: Redis keeps its connections but answers nothing (a hung host, a long fork stall)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after pause()."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: what an OOM kill or a power loss does to the process."""
        if self.process is None:
            return
        self.process.send_signal(signal.SIGKILL)
        self._reap()

    def _reap(self) -> None:
        assert self.process is not None
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def close(self) -> None:
        if self.process is not None:
            self.resume()
            self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalSentinel:
    """A Redis Sentinel (redis-server --sentinel) watching a LocalRedis that listens on TCP."""

    def __init__(self, master: LocalRedis, service: str = "rdvmaster") -> None:
        assert REDIS_SERVER is not None and master.port
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="rdv-sentinel-", dir="/tmp"))
        config = self.dir / "sentinel.conf"
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\nsentinel monitor {service} 127.0.0.1 {master.port} 1\n"
        )
        self.process = subprocess.Popen(
            [REDIS_SERVER, str(config), "--sentinel", "--logfile", str(self.dir / "sentinel.log")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        wait_until(lambda: self._knows(service), START_TIMEOUT_S, "the sentinel to know its master")

    def _knows(self, service: str) -> bool:
        with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2) as c:
            return c.sentinel_get_master_addr_by_name(service) is not None

    def close(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class LocalCluster:
    """A Redis Cluster of three primaries (redis-server --cluster-enabled) on loopback TCP ports."""

    def __init__(self, nodes: int = 3) -> None:
        assert REDIS_SERVER is not None and REDIS_CLI is not None
        self.dir = Path(tempfile.mkdtemp(prefix="rdv-cluster-", dir="/tmp"))
        self.ports = [free_port() for _ in range(nodes)]
        self.processes: list[subprocess.Popen[bytes]] = []
        self.url = f"redis://127.0.0.1:{self.ports[0]}?cluster=true"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, retry=Retry(NoBackoff(), 0))

    def start(self) -> None:
        assert REDIS_SERVER is not None and REDIS_CLI is not None
        for port in self.ports:
            node = self.dir / str(port)
            node.mkdir()
            # The bus port defaults to port + 10000, which overflows for ports above 55535: pick one.
            args = [
                REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(node),
                "--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                "--cluster-config-file", str(node / "nodes.conf"),
                "--save", "", "--appendonly", "no", "--logfile", str(node / "redis.log"),
            ]  # fmt: skip
            self.processes.append(subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        for port in self.ports:
            wait_until(lambda port=port: self.client(port).ping(), START_TIMEOUT_S, f"cluster node {port}")
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas", "0",
             "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        for port in self.ports:
            wait_until(
                lambda port=port: self.client(port).cluster("info")["cluster_state"] == "ok",
                START_TIMEOUT_S,
                f"cluster node {port} to be ok",
            )

    def nodes_holding(self, pattern: str) -> dict[int, list[str]]:
        """Port -> keys matching pattern, for the nodes that hold any."""
        held = {}
        for port in self.ports:
            with self.client(port) as c:
                keys = sorted(k.decode() for k in c.keys(pattern))
            if keys:
                held[port] = keys
        return held

    def close(self) -> None:
        for process in self.processes:
            process.send_signal(signal.SIGKILL)
            process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class DockerRedis:
    """A Redis container (testcontainers) with a fixed host port, so a restart keeps its address."""

    def __init__(self, appendonly: bool = False, image: str = "redis:7") -> None:
        from testcontainers.community.redis import RedisContainer

        self.port = free_port()
        self.container = RedisContainer(image).with_bind_ports(6379, self.port)
        command = "redis-server --save ''"
        if appendonly:
            command += " --appendonly yes --appendfsync everysec"
        self.container.with_command(command)
        self.appendonly = appendonly
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._started = False

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, retry=Retry(NoBackoff(), 0))

    def _ready(self) -> bool:
        with self.client() as c:
            return bool(c.ping())

    def start(self) -> None:
        if not self._started:
            self.container.start()
            self._started = True
        else:
            self.container.get_wrapped_container().start()
        wait_until(self._ready, START_TIMEOUT_S, "the Redis container")

    def stop(self) -> None:
        with contextlib.suppress(redis.ConnectionError), self.client() as c:
            c.shutdown(nosave=not self.appendonly)
        self.container.get_wrapped_container().wait(timeout=10)

    def kill(self) -> None:
        self.container.get_wrapped_container().kill()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.container.stop()


def controlled_redis(appendonly: bool = False) -> ControlledRedis:
    """A Redis this test owns: in Docker where an engine answers, else a local redis-server; or skip."""
    if _use_docker():
        return DockerRedis(appendonly)
    if REDIS_SERVER is not None:
        return LocalRedis(appendonly)
    pytest.skip("needs a Docker engine or a redis-server binary")


_docker: bool | None = None


def _use_docker() -> bool:
    global _docker
    if _docker is None:
        _docker = os.environ.get("RDV_TEST_REDIS", "") != "local" and docker_available()
    return _docker


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """One Redis for the session; isolate with a fresh prefix per test."""
    server = controlled_redis()
    try:
        server.start()
        yield server.url
    finally:
        server.close()


@pytest.fixture
def redis_server() -> Iterator[ControlledRedis]:
    """A Redis of this test's own (no persistence), started."""
    server = controlled_redis()
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def sentinel_redis() -> Iterator[tuple[LocalRedis, LocalSentinel]]:
    """A local Redis on TCP and a Sentinel watching it (local binaries only)."""
    if REDIS_SERVER is None:
        pytest.skip("needs a redis-server binary (Sentinel mode)")
    server = LocalRedis(tcp=True)
    try:
        server.start()
        sentinel = LocalSentinel(server)
        try:
            yield server, sentinel
        finally:
            sentinel.close()
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """A local three-node Redis Cluster for the session (local binaries only)."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("needs redis-server and redis-cli binaries (Cluster mode)")
    cluster = LocalCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def redis_aof_server() -> Iterator[ControlledRedis]:
    """A Redis of this test's own with AOF (appendfsync everysec), started."""
    server = controlled_redis(appendonly=True)
    try:
        server.start()
        yield server
    finally:
        server.close()


__all__ = [
    "REDIS_SERVER",
    "ControlledRedis",
    "DockerRedis",
    "LocalCluster",
    "LocalRedis",
    "LocalSentinel",
    "controlled_redis",
    "docker_available",
    "free_port",
    "fresh_prefix",
    "redis_aof_server",
    "redis_cluster",
    "redis_server",
    "redis_url",
    "sentinel_redis",
    "wait_until",
    "with_prefix",
]
