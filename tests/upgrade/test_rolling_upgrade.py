"""A rolling upgrade from the previous release to the working tree, under load, as docs/operations.md "Upgrading"
says to do it.

The previous release is its wheel, built from its release commit and installed in a venv of its own (conftest.py).
One Redis namespace; replica A serves the previous release and replica B the working tree. Two pairs of engines,
each engine a process of its own driving whole transfer lifecycles with the SDK of its version (driver.py: push and
pull batches; control path only, no NIXL bytes): an old consumer with a new producer, a new consumer with an old
producer. Each engine's client lists both replicas, its own version's first. Under that load the replicas roll one
at a time (SIGTERM, the current version on the same port, wait until it serves and the load went on through it).
Then the engines finish the transfers in hand and every account is checked: each engine ran its own version's SDK,
no refused item, no abort, no re-registration, every lifecycle committed and released in either replica's view, and
nothing left live there (a live transfer pins its target and source blocks).

Every wait is on observed state (files the engines write, the replicas' answers), with generous bounds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from clients import ClientConfig, RendezvousClient, TransferState
from tests.redis_fixtures import fresh_prefix, with_prefix
from tests.replicas.harness import Replica
from tests.wheels import REPO, isolated_env

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(600)]

DRIVER = Path(__file__).with_name("driver.py")
BATCH = 4
WAIT_S = 150.0
"""The bound on any one wait; only a failing fleet waits that long."""


class Engine:
    """One driver.py process: a producer or consumer of the previous release (venv) or the working tree (None)."""

    def __init__(self, role: str, engine_id: str, prefix: str, targets: list[Replica], control: Path,
                 venv: Path | None) -> None:  # fmt: skip
        self.engine_id = engine_id
        self.venv = venv
        self.control = control
        self.log = control / f"{engine_id}.log"
        python = sys.executable if venv is None else str(venv / "bin" / "python")
        env = isolated_env() | ({"PYTHONPATH": str(REPO)} if venv is None else {})
        args = [
            python, str(DRIVER), "--role", role, "--engine", engine_id, "--prefix", prefix, "--batch", str(BATCH),
            "--targets", ",".join(r.address for r in targets), "--control", str(control),
        ]  # fmt: skip
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=venv or REPO
            )

    def _read(self, suffix: str) -> str | None:
        try:
            return (self.control / f"{self.engine_id}.{suffix}").read_text()
        except FileNotFoundError:
            return None

    def progress(self) -> int:
        """Transfers finished so far; an AssertionError (with the engine's log) if it stopped."""
        if self.process.poll() is not None:
            raise AssertionError(f"{self.engine_id} exited with {self.process.returncode}:\n{self.tail()}")
        return int(self._read("progress") or 0)

    def finished(self) -> bool:
        self.progress()
        return self._read("finished") is not None

    def account(self) -> dict[str, object]:
        """What the engine reports after it closed."""
        self.process.wait(timeout=WAIT_S)
        account = self._read("json")
        assert self.process.returncode == 0 and account is not None, f"{self.engine_id}:\n{self.tail()}"
        return dict(json.loads(account))

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
    start = {e.engine_id: e.progress() for e in engines}
    wait_for(lambda: all(e.progress() >= start[e.engine_id] + batches * BATCH for e in engines),
             f"every engine to finish {batches} more batches")  # fmt: skip


@pytest.fixture
def store_url(redis_url: str) -> str:
    return with_prefix(redis_url, fresh_prefix())


@pytest.fixture
def fleet(store_url: str, previous_release_venv: Path) -> Iterator[tuple[Replica, Replica]]:
    """Replica A of the previous release and B of the working tree, on one Redis namespace."""
    a = Replica(store_url, "a", venv=previous_release_venv)
    b = Replica(store_url, "b")
    try:
        a.start()
        b.start()
        yield a, b
    finally:
        a.close()
        b.close()


def test_a_rolling_upgrade_under_load_fails_loses_and_pins_nothing(
    fleet: tuple[Replica, Replica], previous_release_venv: Path, tmp_path: Path
) -> None:
    a, b = fleet
    old = previous_release_venv
    engines = [
        Engine("consumer", "decode-old", "old-new", [a, b], tmp_path, old),
        Engine("producer", "prefill-new", "old-new", [b, a], tmp_path, None),
        Engine("consumer", "decode-new", "new-old", [b, a], tmp_path, None),
        Engine("producer", "prefill-old", "new-old", [a, b], tmp_path, old),
    ]
    try:
        load_goes_on(engines)

        # docs/operations.md, "Upgrading", step 1: the replicas, one at a time.
        for replica in (a, b):
            replica.upgrade()
            load_goes_on(engines)

        total = max(e.progress() for e in engines) + 2 * BATCH
        (tmp_path / "stop").write_text(str(total))
        wait_for(lambda: all(e.finished() for e in engines), f"every engine to finish {total} transfers")

        expected = {f"{prefix}-{n}" for prefix in ("old-new", "new-old") for n in range(total)}
        for replica in (a, b):
            with RendezvousClient(ClientConfig(targets=(replica.address,))) as view:
                assert list(view.iter_transfers()) == [], f"live transfers in {replica.name}'s view"
                released = {t.transfer_id for t in view.iter_transfers(states=[TransferState.RELEASED])}
                assert released == expected, f"{replica.name}: not released: {sorted(expected - released)[:10]}"
                assert list(view.iter_transfers(states=[TransferState.ABORTED])) == []

        (tmp_path / "close").write_text("")
        for engine in engines:
            account = engine.account()
            sdk = Path(str(account.pop("sdk")))
            assert sdk.is_relative_to(engine.venv or REPO), f"{engine.engine_id} ran the SDK in {sdk}"
            assert account == {"finished": total, "failures": [], "reregistered": 0}, engine.engine_id
        for replica in (a, b):
            with RendezvousClient(ClientConfig(targets=(replica.address,))) as view:
                assert view.get_status().live_engines == 0
    finally:
        for engine in engines:
            engine.kill()
