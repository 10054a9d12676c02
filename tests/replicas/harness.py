"""Real server replicas for tests: `kv-rendezvous serve` processes on loopback, and a workload of
consumer and producer sessions that counts what each transfer went through.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvous.clients import (
    AsyncRendezvousClient,
    ClaimSpec,
    ClientConfig,
    CompletionSpec,
    ConsumerSession,
    Event,
    EventType,
    ProducerSession,
    ReleaseSpec,
    Reregistered,
    RetryPolicy,
    SessionConfig,
    SessionEvent,
    TargetSpec,
    mint_transfer_id,
)
from tests.factories import SDK_LAYOUT, sdk_agent
from tests.wheels import isolated_env

START_TIMEOUT_S = 20.0
WAIT_S = 15.0
"""How long a test waits for something that should happen soon; only a failing test waits that long."""

FAST_RETRY = RetryPolicy(initial_backoff=0.02, max_backoff=0.2, deadline=20.0)
FAST_SESSION = SessionConfig(reconnect=RetryPolicy(initial_backoff=0.02, max_backoff=0.2))
_SERVING = re.compile(r"serving on (\S+)")


class Replica:
    """One `kv-rendezvous serve` process on 127.0.0.1; it keeps its port across restarts.

    It serves the working tree's code, or with `venv` the kv-rendezvous installed there (tests/wheels.py), run
    from that venv with nothing of the repository on its path.
    """

    def __init__(
        self, store_url: str, name: str = "replica", extra_args: Sequence[str] = (), venv: Path | None = None
    ) -> None:
        self.store_url = store_url
        self.name = name
        self.extra_args = tuple(extra_args)
        self.venv = venv
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log = Path(tempfile.mkstemp(prefix=f"rdv-{name}-", suffix=".log")[1])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start serving (on a free port the first time, the same one afterwards); wait until it listens."""
        assert self.process is None
        python = sys.executable if self.venv is None else str(self.venv / "bin" / "python")
        args = [
            python, "-m", "rendezvous.cli", "serve",
            "--listen", f"127.0.0.1:{self.port}",
            "--store", self.store_url,
            "--metrics-listen", "off",
            "--drain", "0",
            "--grace", "1",
            "--log-level", "warning",
            *self.extra_args,
        ]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1") if self.venv is None else isolated_env()
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=env, cwd=self.venv
            )
        self.port = int(self._read_address().rpartition(":")[2])

    def _read_address(self) -> str:
        assert self.process is not None and self.process.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            buffered = b""
            while time.monotonic() < deadline:
                if selector.select(timeout=0.1):
                    chunk = os.read(self.process.stdout.fileno(), 4096)
                    if not chunk:
                        break
                    buffered += chunk
                    found = _SERVING.search(buffered.decode(errors="replace"))
                    if found:
                        return found.group(1)
                elif self.process.poll() is not None:
                    break
        self.kill()
        raise RuntimeError(f"{self.name} did not start: {self.log.read_text(errors='replace')[-3000:]}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """kill -9."""
        if self.process is None:
            return
        self.process.send_signal(signal.SIGKILL)
        self._reap()

    def terminate(self) -> None:
        """SIGTERM: a graceful stop."""
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        self._reap()

    def _reap(self) -> None:
        assert self.process is not None
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.process = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def upgrade(self, venv: Path | None = None) -> None:
        """Stop gracefully (SIGTERM) and serve `venv`'s version (None: the working tree's) on the same port."""
        self.terminate()
        self.venv = venv
        self.start()

    def close(self) -> None:
        self.kill()
        with contextlib.suppress(FileNotFoundError):
            self.log.unlink()


@contextlib.contextmanager
def two_replicas(url: str) -> Iterator[tuple[Replica, Replica]]:
    """Replicas "a" and "b" of `kv-rendezvous serve` on one store URL, closed afterwards."""
    a, b = Replica(url, "a"), Replica(url, "b")
    try:
        a.start()
        b.start()
        yield a, b
    finally:
        a.close()
        b.close()


async def health(address: str) -> int:
    """The server's overall health status (health_pb2.HealthCheckResponse.SERVING, NOT_SERVING, ...)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
        return int(response.status)


async def eventually(predicate: object, what: str, timeout: float = WAIT_S, interval: float = 0.02) -> None:
    """Poll an async or plain predicate until true; fail naming `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            result = predicate()  # type: ignore[operator]
            if asyncio.iscoroutine(result):
                result = await result
            if result:
                return
        except Exception as err:
            last = err
        await asyncio.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout} s waiting for {what}" + (f" (last error: {last!r})" if last else "")
    )


def client(*addresses: str) -> AsyncRendezvousClient:
    """A client that fails over across addresses in order."""
    return AsyncRendezvousClient(ClientConfig(targets=addresses, retry=FAST_RETRY, call_timeout=5.0))


class Workload:
    """A consumer and a producer session completing push transfers, counting every event they see.

    The producer completes each TRANSFER_ASSIGNED it hears; the consumer releases each TRANSFER_COMMITTED.
    """

    def __init__(self, consumer_client: AsyncRendezvousClient, producer_client: AsyncRendezvousClient) -> None:
        self.consumer = ConsumerSession(
            consumer_client, "decode-0", "decode", layout=SDK_LAYOUT, agents=(sdk_agent("decode-0-0"),),
            config=FAST_SESSION, handler=self._on_consumer_event,
        )  # fmt: skip
        self.producer = ProducerSession(
            producer_client, "prefill-0", "prefill", layout=SDK_LAYOUT, agents=(sdk_agent("prefill-0-0"),),
            config=FAST_SESSION, handler=self._on_producer_event,
        )  # fmt: skip
        self.minted: list[str] = []
        self.assigned: Counter[str] = Counter()
        self.committed: Counter[str] = Counter()
        self.released: Counter[str] = Counter()
        self.reregistered: list[Reregistered] = []
        self.errors: list[BaseException] = []

    async def start(self) -> None:
        await self.consumer.start()
        await self.producer.start()

    async def close(self) -> None:
        for session in (self.producer, self.consumer):
            with contextlib.suppress(Exception):
                await session.close()

    async def _on_producer_event(self, item: SessionEvent) -> None:
        if isinstance(item, Reregistered):
            self.reregistered.append(item)
        elif isinstance(item, Event) and item.type == EventType.TRANSFER_ASSIGNED and item.transfer is not None:
            self.assigned[item.transfer.transfer_id] += 1
            await self._retrying(
                self.producer.complete_transfer, CompletionSpec(item.transfer.transfer_id, item.generation)
            )

    async def _on_consumer_event(self, item: SessionEvent) -> None:
        if isinstance(item, Reregistered):
            self.reregistered.append(item)
        elif isinstance(item, Event) and item.type == EventType.TRANSFER_COMMITTED and item.transfer is not None:
            tid = item.transfer.transfer_id
            self.committed[tid] += 1
            await self._retrying(self.consumer.release_target, ReleaseSpec(tid, item.generation))
            self.released[tid] += 1

    async def _retrying(self, call: object, spec: object) -> None:
        try:
            await call(spec)  # type: ignore[operator]
        except Exception as err:
            self.errors.append(err)

    async def send(self, count: int, batch: int = 5) -> None:
        """Start `count` transfers, `batch` at a time: both legs at once, as a router sends them."""
        for _ in range(0, count, batch):
            ids = [mint_transfer_id() for _ in range(batch)]
            self.minted.extend(ids)
            await asyncio.gather(
                self.consumer.register_targets([TargetSpec(t, (1, 2, 3)) for t in ids]),
                self.producer.claim_transfers([ClaimSpec(t) for t in ids]),
            )

    def done(self) -> bool:
        return all(self.released[t] for t in self.minted)

    def check_exactly_once(self) -> None:
        """Every minted transfer was assigned, committed and released exactly once."""
        assert not self.errors, self.errors
        for name, seen in (("assigned", self.assigned), ("committed", self.committed), ("released", self.released)):
            wrong = {t: seen[t] for t in self.minted if seen[t] != 1}
            assert not wrong, f"transfers {name} other than once: {wrong}"
