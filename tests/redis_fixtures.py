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
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback TCP ports nobody listens on right now (all bound at once, so none repeats)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


class LocalSentinel:
    """A Redis Sentinel (redis-server --sentinel) watching a LocalRedis that listens on TCP.

    quorum, down_after_ms and failover_timeout_ms are Sentinel's own settings for the monitored master
    (Sentinel's defaults are 30 s and 3 min; a failover test wants about a second).
    """

    def __init__(
        self,
        master: LocalRedis,
        service: str = "rdvmaster",
        quorum: int = 1,
        down_after_ms: int | None = None,
        failover_timeout_ms: int | None = None,
    ) -> None:
        assert REDIS_SERVER is not None and master.port
        self.port = free_port()
        self.service = service
        self.dir = Path(tempfile.mkdtemp(prefix="rdv-sentinel-", dir="/tmp"))
        config = self.dir / "sentinel.conf"
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f"dir {self.dir}",
            f"sentinel monitor {service} 127.0.0.1 {master.port} {quorum}",
        ]
        if down_after_ms is not None:
            lines.append(f"sentinel down-after-milliseconds {service} {down_after_ms}")
        if failover_timeout_ms is not None:
            lines.append(f"sentinel failover-timeout {service} {failover_timeout_ms}")
        config.write_text("\n".join(lines) + "\n")
        self.process = subprocess.Popen(
            [REDIS_SERVER, str(config), "--sentinel", "--logfile", str(self.dir / "sentinel.log")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        wait_until(lambda: self._knows(service), START_TIMEOUT_S, "the sentinel to know its master")

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, retry=Retry(NoBackoff(), 0))

    def _knows(self, service: str) -> bool:
        with self.client() as c:
            return c.sentinel_get_master_addr_by_name(service) is not None

    def master(self) -> dict[str, object]:
        """SENTINEL MASTER: what this Sentinel knows of its master (port, flags, num-slaves, num-other-sentinels)."""
        with self.client() as c:
            return dict(c.sentinel_master(self.service))

    def master_port(self) -> int | None:
        with self.client() as c:
            address = c.sentinel_get_master_addr_by_name(self.service)
        return None if address is None else int(address[1])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelTopology:
    """One master, `replicas` replicas (`--replicaof`) and `sentinels` Sentinels (quorum 2 by default), all local.

    `kill_master()` SIGKILLs the current master (or SIGSTOPs it: `pause=True`); `wait_promoted()` polls until
    every Sentinel names another node as master and that node says it is one. The URL is a store URL
    (redis+sentinel://...) naming every Sentinel.
    """

    def __init__(
        self,
        replicas: int = 1,
        sentinels: int = 3,
        quorum: int = 2,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        service: str = "rdvmaster",
        extra: tuple[str, ...] = (),
    ) -> None:
        self.service = service
        self.nodes = [LocalRedis(tcp=True, extra=extra)]
        self.replica_count = replicas
        self.sentinel_count = sentinels
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.extra = extra
        self.sentinels: list[LocalSentinel] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}"

    def start(self) -> None:
        master = self.nodes[0]
        master.start()
        for _ in range(self.replica_count):
            node = LocalRedis(tcp=True, extra=(*self.extra, "--replicaof", "127.0.0.1", str(master.port)))
            self.nodes.append(node)
            node.start()
        for node in self.nodes[1:]:
            wait_until(lambda node=node: self.role(node) == "slave" and self._linked(node), START_TIMEOUT_S,
                       f"replica {node.port} to sync")  # fmt: skip
        for _ in range(self.sentinel_count):
            self.sentinels.append(
                LocalSentinel(master, self.service, self.quorum, self.down_after_ms, self.failover_timeout_ms)
            )
        # A failover needs the Sentinels to know each other (hello messages, every 2 s) and the replicas.
        wait_until(self._ready, START_TIMEOUT_S, "the Sentinels to know each other and the replicas")

    def _ready(self) -> bool:
        for sentinel in self.sentinels:
            known = sentinel.master()
            if int(known["num-other-sentinels"]) < self.sentinel_count - 1:  # type: ignore[call-overload]
                return False
            if int(known["num-slaves"]) < self.replica_count:  # type: ignore[call-overload]
                return False
        return True

    @staticmethod
    def role(node: LocalRedis) -> str:
        with node.client() as c:
            return str(c.info("replication")["role"])

    @staticmethod
    def _linked(node: LocalRedis) -> bool:
        with node.client() as c:
            return bool(c.info("replication").get("master_link_status") == "up")

    def master(self) -> LocalRedis:
        """The node the Sentinels name as master now."""
        port = self.sentinels[0].master_port()
        return next(node for node in self.nodes if node.port == port)

    def kill_master(self, pause: bool = False) -> LocalRedis:
        """SIGKILL (or SIGSTOP) the current master; returns it."""
        master = self.master()
        if pause:
            master.pause()
        else:
            master.kill()
        return master

    def wait_promoted(self, old: LocalRedis, timeout: float = 60.0) -> LocalRedis:
        """Poll until every Sentinel names a node other than old as master and that node is one; returns it."""

        def promoted() -> bool:
            ports = {sentinel.master_port() for sentinel in self.sentinels}
            if len(ports) != 1 or old.port in ports:
                return False
            node = next(node for node in self.nodes if node.port in ports)
            return self.role(node) == "master"

        wait_until(promoted, timeout, f"a replica to be promoted in place of {old.port}", interval=0.05)
        return self.master()

    def close(self) -> None:
        for sentinel in self.sentinels:
            sentinel.close()
        for node in self.nodes:
            node.close()


class LocalCluster:
    """A Redis Cluster of `nodes` primaries (redis-server --cluster-enabled) on loopback TCP ports, each with
    `replicas` replicas; `node_timeout_ms` is cluster-node-timeout (how soon a silent primary is failed over)."""

    def __init__(self, nodes: int = 3, replicas: int = 0, node_timeout_ms: int = 15000) -> None:
        assert REDIS_SERVER is not None and REDIS_CLI is not None
        self.dir = Path(tempfile.mkdtemp(prefix="rdv-cluster-", dir="/tmp"))
        count = nodes * (1 + replicas)
        ports = free_ports(2 * count)  # each node's port and its cluster bus port, all distinct
        self.ports, self.bus_ports = ports[:count], ports[count:]
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.processes: list[subprocess.Popen[bytes]] = []
        self.args: dict[int, list[str]] = {}
        self.url = f"redis://127.0.0.1:{self.ports[0]}?cluster=true"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, retry=Retry(NoBackoff(), 0))

    def start(self) -> None:
        assert REDIS_SERVER is not None and REDIS_CLI is not None
        for port, bus_port in zip(self.ports, self.bus_ports, strict=True):
            node = self.dir / str(port)
            node.mkdir()
            # The bus port defaults to port + 10000, which overflows for ports above 55535: pick one.
            args = [
                REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(node),
                "--cluster-enabled", "yes", "--cluster-port", str(bus_port),
                "--cluster-config-file", str(node / "nodes.conf"),
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--save", "", "--appendonly", "no", "--logfile", str(node / "redis.log"),
            ]  # fmt: skip
            self.args[port] = args
            self.processes.append(subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        for port in self.ports:
            wait_until(lambda port=port: self.client(port).ping(), START_TIMEOUT_S, f"cluster node {port}")
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas",
             str(self.replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        for port in self.ports:
            wait_until(
                lambda port=port: self._ok(port),
                START_TIMEOUT_S,
                f"cluster node {port} to be ok",
            )

    def _ok(self, port: int) -> bool:
        with self.client(port) as c:
            if c.cluster("info")["cluster_state"] != "ok":
                return False
            info = c.info("replication")
            return bool(info["role"] == "master" or info.get("master_link_status") == "up")

    def master_of(self, key: str) -> int:
        """The port of the primary that serves key's slot now (as a live node sees it)."""
        for port in self.live_ports():
            with contextlib.suppress(redis.RedisError), self.client(port) as c:
                slot = int(c.cluster("keyslot", key))
                for start, end, primary, *_ in c.cluster("slots"):
                    if start <= slot <= end:
                        return int(primary[1])
        raise RuntimeError(f"no live node knows who serves {key!r}")

    def replicas_of(self, port: int) -> list[int]:
        """The ports of the replicas of the primary on port."""
        with self.client(port) as c:
            info = c.info("replication")
        return [int(v["port"]) for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]

    def replica_has(self, port: int, key: str) -> bool:
        """Whether the replica on port holds key (READONLY: a cluster replica answers reads of its slots)."""
        with self.client(port) as c:
            c.execute_command("READONLY")
            return bool(c.exists(key))

    def live_ports(self) -> list[int]:
        return [port for port, process in zip(self.ports, self.processes, strict=True) if process.poll() is None]

    def kill(self, port: int, pause: bool = False) -> None:
        """SIGKILL (or SIGSTOP) the node on port."""
        process = self.processes[self.ports.index(port)]
        if pause:
            process.send_signal(signal.SIGSTOP)
        else:
            process.send_signal(signal.SIGKILL)
            process.wait()

    def restart(self, port: int) -> None:
        """Start the (killed) node on port again: it rejoins from its nodes.conf, as a replica if it was failed over."""
        index = self.ports.index(port)
        assert self.processes[index].poll() is not None
        self.processes[index] = subprocess.Popen(self.args[port], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        wait_until(lambda: self.client(port).ping(), START_TIMEOUT_S, f"cluster node {port} to restart")

    def resume(self, port: int) -> None:
        self.processes[self.ports.index(port)].send_signal(signal.SIGCONT)

    def wait_promoted(self, key: str, old: int, timeout: float = 60.0) -> int:
        """Poll until a node other than old serves key's slot as primary and the cluster is ok; returns its port."""

        def promoted() -> bool:
            port = self.master_of(key)
            if port == old:
                return False
            with self.client(port) as c:
                return bool(c.info("replication")["role"] == "master" and c.cluster("info")["cluster_state"] == "ok")

        wait_until(promoted, timeout, f"a replica to take over {key!r} from {old}", interval=0.05)
        return self.master_of(key)

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
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
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


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def store(request: pytest.FixtureRequest) -> str:
    """Each test twice: on the memory store ("memory") and on the session's Redis under a fresh prefix (its URL)."""
    if request.param == "memory":
        return "memory"
    url: str = request.getfixturevalue("redis_url")
    return with_prefix(url, fresh_prefix())


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
    "SentinelTopology",
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
