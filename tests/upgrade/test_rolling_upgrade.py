"""A rolling upgrade from the previous release to the working tree, under load, as docs/operations.md "Upgrading"
says to do it.

The previous release is its wheel, built from its release commit and installed in a venv of its own (conftest.py).
One Redis namespace; replica A serves the previous release and replica B the working tree. Two pairs of engines,
each engine a process of its own driving whole transfer lifecycles with the SDK of its version (driver.py: push and
pull batches), on the control path alone or with real NIXL writes and reads over DRAM (checked byte for byte). Old
and new engines are paired across versions (OLD_ENGINES). Each engine's client lists both replicas, its own
version's first. Under that load the fleet upgrades: the replicas one at a time (SIGTERM, the current version on the
same port, SERVING), then the old consumers, then the old producers (finish the transfers in hand, deregister, the
current version under the same engine id), each step once the load went on through the last. Then the engines finish
the transfers in hand and every account is checked: each engine ran its own version's SDK, no refused item, no
abort, no failed write or read, no re-registration, every lifecycle committed and released in either replica's view,
nothing left live there (a live transfer pins its target and source blocks), and no block, engine or agent metadata
left charged in the store's budget sums.

Every wait is on observed state (files the engines write, the replicas' answers), with generous bounds.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from rendezvous.clients import ClientConfig, RendezvousClient, TransferState
from rendezvous.core.budget import Usage
from rendezvous.core.limits import Limits
from rendezvous.store.factory import create_store
from tests.redis_fixtures import fresh_prefix, with_prefix
from tests.replicas.harness import Replica, health
from tests.wheels import REPO, isolated_env

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(600)]

DRIVER = Path(__file__).with_name("driver.py")
BATCH = 4
WAIT_S = 150.0
"""The bound on any one wait; only a failing fleet waits that long."""


class Engine:
    """One driver.py process: a producer or consumer of the previous release (venv) or the working tree (None).

    `start` is the first transfer number it works on: an engine restarted as the other version carries on there.
    """

    def __init__(self, role: str, engine_id: str, prefix: str, targets: list[Replica], control: Path,
                 venv: Path | None, data_plane: str, start: int = 0) -> None:  # fmt: skip
        self.role, self.engine_id, self.prefix, self.targets = role, engine_id, prefix, targets
        self.data_plane = data_plane
        self.venv = venv
        self.start = start
        self.name = f"{engine_id}.{'old' if venv else 'new'}"
        self.control = control
        self.log = control / f"{self.name}.log"
        python = sys.executable if venv is None else str(venv / "bin" / "python")
        env = isolated_env() | ({"PYTHONPATH": str(REPO)} if venv is None else {})
        args = [
            python, str(DRIVER), "--role", role, "--engine", engine_id, "--name", self.name, "--prefix", prefix,
            "--start", str(start), "--batch", str(BATCH), "--targets", ",".join(r.address for r in targets),
            "--control", str(control), "--data-plane", data_plane,
        ]  # fmt: skip
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=venv or REPO
            )

    def _read(self, suffix: str) -> str | None:
        try:
            return (self.control / f"{self.name}.{suffix}").read_text()
        except FileNotFoundError:
            return None

    def progress(self) -> int:
        """The next transfer number; an AssertionError (with the engine's log) if it stopped."""
        if self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")
        return int(self._read("progress") or self.start)

    def finished(self) -> bool:
        self.progress()
        return self._read("finished") is not None

    def stopped_at(self) -> int:
        """Where a finished engine stopped: the transfer number it finished up to."""
        return int(self._read("finished") or 0)

    def tell(self, suffix: str, text: str = "") -> None:
        """Write this process's control file <name>.<suffix> (stop, close)."""
        (self.control / f"{self.name}.{suffix}").write_text(text)

    def account(self) -> dict[str, object]:
        """What the engine reports after it closed; checks it ran its own version's SDK."""
        self.process.wait(timeout=WAIT_S)
        account = self._read("json")
        assert self.process.returncode == 0 and account is not None, f"{self.name}:\n{self.tail()}"
        found = dict(json.loads(account))
        sdk = Path(str(found.pop("sdk")))
        assert sdk.is_relative_to(self.venv or REPO), f"{self.name} ran the SDK in {sdk}"
        return found

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll until condition() holds; its AssertionErrors (a stopped engine) end the wait at once."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {WAIT_S} s waiting for {what}")
        time.sleep(0.05)


def load_goes_on(engines: list[Engine], batches: int = 2) -> None:
    """Wait until every engine has finished `batches` more batches than now."""
    start = {e.name: e.progress() for e in engines}
    wait_for(lambda: all(e.progress() >= start[e.name] + batches * BATCH for e in engines),
             f"every engine to finish {batches} more batches")  # fmt: skip


def upgrade_engine(engines: list[Engine], old: Engine) -> None:
    """docs/operations.md "Upgrading", steps 2 and 3, for one engine: let it finish the transfers in hand (and its
    peer finish them too), deregister it, and start the working tree's version of it where it stopped."""
    (peer,) = (e for e in engines if e.prefix == old.prefix and e is not old)
    at = max(old.progress(), peer.progress()) + BATCH
    old.tell("stop", str(at))
    # It stops at `at`, or past it on a loaded machine: a batch it began before it read the stop is finished whole.
    wait_for(old.finished, f"{old.name} to stop at {at}")
    stopped = old.stopped_at()
    wait_for(lambda: peer.progress() >= stopped, f"{peer.name} to reach {stopped}")
    old.tell("close")
    assert stopped >= at, f"{old.name} stopped at {stopped}, before {at}"
    assert old.account() == {"finished": stopped, "failures": [], "reregistered": 0}, old.name
    new = Engine(old.role, old.engine_id, old.prefix, old.targets, old.control, None, old.data_plane, stopped)
    engines[engines.index(old)] = new
    load_goes_on(engines)


def store_usage(url: str) -> Usage:
    """What the store's records charge the memory budget, server-wide: its exact sums, kept by every replica."""

    async def read() -> Usage:
        store = create_store(url, Limits())
        await store.open()
        try:
            return (await store.usage("")).total
        finally:
            await store.close()

    return asyncio.run(read())


@pytest.fixture
def store_url(redis_url: str) -> str:
    return with_prefix(redis_url, fresh_prefix())


@pytest.fixture
def fleet(store_url: str, previous_release_venv: Path) -> Iterator[tuple[Replica, Replica]]:
    """Replica A of the previous release and B of the working tree, on one Redis namespace. They stop as a deployed
    replica does (docs/operations.md, "Upgrading"): NOT_SERVING for a second, then running calls get their grace."""
    stop = ("--drain", "1", "--grace", "5")
    a = Replica(store_url, "a", stop, venv=previous_release_venv)
    b = Replica(store_url, "b", stop)
    try:
        a.start()
        b.start()
        yield a, b
    finally:
        a.close()
        b.close()


OLD_ENGINES = {
    "none": ("decode-a", "prefill-b"),
    "nixl": ("decode-a", "decode-b", "prefill-a", "prefill-b"),
}
"""The engines that start as the previous release. Control path only (no data-plane version stated), new engines
run beside the old replica from the start and an old consumer pairs with a new producer too. With NIXL every engine
starts old and upgrades in the documented order, servers first, then consumers, then producers: a new engine
speaks a data-plane version the previous release's servers do not know (4; they know 3, and abort a pair they
cannot judge), and a new producer one an old consumer cannot read. Between the consumers' step and the producers'
old producers write into new consumers."""


@pytest.mark.parametrize("data_plane", ["none", pytest.param("nixl", marks=pytest.mark.nixl)])
def test_a_rolling_upgrade_under_load_fails_loses_and_pins_nothing(
    fleet: tuple[Replica, Replica], store_url: str, previous_release_venv: Path, tmp_path: Path, data_plane: str
) -> None:
    if data_plane == "nixl":
        pytest.importorskip("nixl")
    a, b = fleet
    engines = []
    for pair in ("a", "b"):
        for role, pool in (("consumer", "decode"), ("producer", "prefill")):
            old = f"{pool}-{pair}" in OLD_ENGINES[data_plane]
            venv, targets = (previous_release_venv, [a, b]) if old else (None, [b, a])
            engines.append(Engine(role, f"{pool}-{pair}", pair, targets, tmp_path, venv, data_plane))
    try:
        load_goes_on(engines)

        # docs/operations.md, "Upgrading": 1. the replicas, one at a time;
        for replica in (a, b):
            replica.upgrade()
            assert asyncio.run(health(replica.address)) == health_pb2.HealthCheckResponse.SERVING
            load_goes_on(engines)
        # 2. the consumers; 3. the producers, an engine at a time.
        for role in ("consumer", "producer"):
            for engine in [e for e in engines if e.role == role and e.venv is not None]:
                upgrade_engine(engines, engine)

        total = max(e.progress() for e in engines) + 2 * BATCH
        (tmp_path / "stop").write_text(str(total))
        wait_for(lambda: all(e.finished() for e in engines), f"every engine to finish {total} transfers")

        expected = {f"{prefix}-{n}" for prefix in ("a", "b") for n in range(total)}
        for replica in (a, b):
            with RendezvousClient(ClientConfig(targets=(replica.address,))) as view:
                assert list(view.iter_transfers()) == [], f"live transfers in {replica.name}'s view"
                released = {t.transfer_id for t in view.iter_transfers(states=[TransferState.RELEASED])}
                assert released == expected, f"{replica.name}: not released: {sorted(expected - released)[:10]}"
                assert list(view.iter_transfers(states=[TransferState.ABORTED])) == []
        charged = store_usage(store_url)
        assert (charged.engines, charged.blocks) == (len(engines), 0), "blocks of ended transfers are still charged"

        (tmp_path / "close").write_text("")
        for engine in engines:
            assert engine.venv is None
            assert engine.account() == {"finished": total, "failures": [], "reregistered": 0}, engine.name
        for replica in (a, b):
            with RendezvousClient(ClientConfig(targets=(replica.address,))) as view:
                assert view.get_status().live_engines == 0
        assert store_usage(store_url) == Usage()
    finally:
        for engine in engines:
            engine.kill()
