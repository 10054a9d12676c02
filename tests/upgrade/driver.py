"""One engine of the mixed-version test: a producer or a consumer doing whole transfer lifecycles until told to stop.

Run as a script by the interpreter whose SDK it exercises (a previous release's venv or the current tree), so it
imports the SDK's public names only and nothing of the tests. Two data planes (--data-plane): `none`, the control
path alone (an engine session with the stand-in agent of `rendezvous.clients.testing` does each step, no bytes move),
and `nixl`, the SDK's NIXL agents over DRAM (`rendezvous.clients.nixl`: they move the bytes and do the steps; the
consumer checks every byte that lands).

Transfer ids are `<prefix>-<n>`; a producer and a consumer given the same prefix work the same ids in the same
order, a batch at a time, and alternate push batches (claim -> TRANSFER_ASSIGNED -> complete -> TRANSFER_COMMITTED
-> release) with pull batches (claim and mark the source ready -> SOURCE_READY -> the consumer completes ->
TRANSFER_COMMITTED to the producer; the consumer releases).

Control, through files in --control, named after the process (--name, default the engine id): after each batch
the driver writes `<name>.progress` (the next transfer number). A file `stop` (the fleet's) or `<name>.stop` (this
process's) holding a number N makes it finish transfers up to N and write `<name>.finished`; then a file `close` or
`<name>.close` makes it deregister, write `<name>.json` (its account: transfers finished up to, failures,
re-registrations, and where its SDK was imported from) and exit. An engine restarted as another version is a new
process with the same engine id and prefix and `--start N`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from rendezvous import clients
from rendezvous.clients import (
    AsyncRendezvousClient,
    ClaimSpec,
    ClientConfig,
    CompletionSpec,
    ConsumerSession,
    Event,
    EventType,
    ItemResult,
    KvLayout,
    ProducerSession,
    ReleaseSpec,
    Reregistered,
    RetryPolicy,
    SessionConfig,
    SessionEvent,
    SourceReadySpec,
    TargetSpec,
    TransferMode,
)
from rendezvous.clients.testing import stand_in_agent

LAYOUT = KvLayout(model_fingerprint="upgrade-test-model", dtype="float16", block_size=16, num_layers=2)
BATCH_TIMEOUT_S = 120.0
"""How long one batch may take; only a failing fleet waits that long."""
POLL_S = 0.05
BLOCKS_PER_TRANSFER = 2
BLOCK_BYTES = 4096


class Driver:
    """One engine's loop and its account of what happened; the subclasses move the transfers."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.engine_id: str = args.engine
        self.role: str = args.role
        self.name: str = args.name or args.engine
        self.prefix: str = args.prefix
        self.batch: int = args.batch
        self.control = Path(args.control)
        self.client = AsyncRendezvousClient(
            ClientConfig(
                targets=tuple(args.targets.split(",")),
                retry=RetryPolicy(initial_backoff=0.02, max_backoff=0.5, deadline=60.0),
                call_timeout=10.0,
            )
        )
        self.session_config = SessionConfig(reconnect=RetryPolicy(initial_backoff=0.02, max_backoff=0.5))
        self.finished: int = args.start
        self.failures: list[str] = []
        self.reregistered = 0
        self.waiting: dict[str, asyncio.Future[None]] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    async def open(self) -> None:
        """Register the engine."""
        raise NotImplementedError

    async def shut(self) -> None:
        """Deregister the engine."""
        raise NotImplementedError

    async def begin(self, ids: Sequence[str], mode: TransferMode) -> None:
        """Start this engine's half of a batch's transfers; each one's future in `waiting` ends its part."""
        raise NotImplementedError

    # The loop

    async def run(self) -> None:
        await self.open()
        try:
            while self.finished < self.stop_at():
                ids = [f"{self.prefix}-{n}" for n in range(self.finished, self.finished + self.batch)]
                mode = TransferMode.PUSH if self.finished // self.batch % 2 == 0 else TransferMode.PULL
                await self.lifecycles(ids, mode)
                self.finished += self.batch
                self.write("progress", str(self.finished))
            self.write("finished", str(self.finished))
            await self.until(lambda: any((self.control / f).exists() for f in ("close", f"{self.name}.close")))
        except Exception as err:
            self.failures.append(f"stopped at {self.finished}: {err!r}")
            raise
        finally:
            await self.shut()
            await self.client.close()
            account = {
                "finished": self.finished,
                "failures": self.failures,
                "reregistered": self.reregistered,
                "sdk": str(Path(clients.__file__).parent),
            }
            self.write("json", json.dumps(account))

    async def lifecycles(self, ids: Sequence[str], mode: TransferMode) -> None:
        """Start a batch's transfers and wait until this engine's part of each is done."""
        loop = asyncio.get_running_loop()
        self.waiting = {t: loop.create_future() for t in ids}
        await self.begin(ids, mode)
        try:
            await asyncio.wait_for(asyncio.gather(*self.waiting.values()), BATCH_TIMEOUT_S)
        except TimeoutError:
            left = sorted(t for t, f in self.waiting.items() if not f.done())
            raise TimeoutError(f"timed out after {BATCH_TIMEOUT_S} s waiting for {left}") from None

    def done(self, tid: str, failure: str = "") -> None:
        """This engine's part of transfer tid is over (failed, when `failure` says why)."""
        if failure:
            self.failures.append(f"{tid}: {failure}")
        waiting = self.waiting.get(tid)
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    def check(self, results: Sequence[ItemResult]) -> None:
        self.failures.extend(f"{r.transfer_id} refused: {r.error!r}" for r in results if not r.ok)

    # Control files

    def stop_at(self) -> float:
        """Where to stop: the lower of the fleet's `stop` and this process's `<name>.stop` (none: never)."""
        return min(self._number(self.control / f) for f in ("stop", f"{self.name}.stop"))

    @staticmethod
    def _number(path: Path) -> float:
        try:
            return int(path.read_text())
        except (FileNotFoundError, ValueError):
            return float("inf")

    def write(self, suffix: str, text: str) -> None:
        """Write <name>.<suffix> whole (a reader never sees half of it)."""
        path = self.control / f"{self.name}.{suffix}"
        partial = path.with_suffix(".partial")
        partial.write_text(text)
        os.replace(partial, path)

    @staticmethod
    async def until(condition: Callable[[], bool]) -> None:
        while not condition():  # noqa: ASYNC110 - a file the test writes: nothing in this process to await
            await asyncio.sleep(POLL_S)


class SessionDriver(Driver):
    """The control path alone: an engine session with a stand-in agent does each step itself, no bytes move."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        kind = ConsumerSession if args.role == "consumer" else ProducerSession
        self.session = kind(
            self.client, self.engine_id, args.role, layout=LAYOUT, agents=(stand_in_agent(f"{self.engine_id}-0"),),
            config=self.session_config, handler=self.on_event,
        )  # fmt: skip

    async def open(self) -> None:
        await self.session.start()

    async def shut(self) -> None:
        await self.session.close()

    async def begin(self, ids: Sequence[str], mode: TransferMode) -> None:
        session = self.session
        if isinstance(session, ConsumerSession):
            self.check(await session.register_targets([TargetSpec(t, (1, 2, 3), mode=mode) for t in ids]))
        else:
            self.check(await session.claim_transfers([ClaimSpec(t) for t in ids]))
            if mode == TransferMode.PULL:
                self.check(await session.mark_sources_ready([SourceReadySpec(t, (4, 5, 6)) for t in ids]))

    async def on_event(self, item: SessionEvent) -> None:
        if isinstance(item, Reregistered):
            self.reregistered += 1
            return
        if not isinstance(item, Event) or item.transfer is None:
            return
        tid, generation = item.transfer.transfer_id, item.generation
        waiting = self.waiting.get(tid)
        if waiting is None or waiting.done():
            return  # a redelivered event, or another batch's
        if item.type == EventType.TRANSFER_ABORTED:
            self.done(tid, f"aborted: {item.transfer.abort_reason} {item.transfer.abort_message}")
        elif item.type == EventType.TRANSFER_ASSIGNED:  # producer, push
            self.spawn(tid, self.session.complete_transfers([CompletionSpec(tid, generation)]))
        elif item.type == EventType.SOURCE_READY:  # consumer, pull: "read", report, release
            self.spawn(tid, self.complete_and_release(tid, generation))
        elif item.type == EventType.TRANSFER_COMMITTED:
            if isinstance(self.session, ConsumerSession):  # push: the bytes arrived
                self.spawn(tid, self.session.release_targets([ReleaseSpec(tid, generation)]))
            else:  # pull: the consumer read the source
                self.done(tid)

    async def complete_and_release(self, tid: str, generation: int) -> list[ItemResult]:
        assert isinstance(self.session, ConsumerSession)
        completed = await self.session.complete_transfers([CompletionSpec(tid, generation)])
        if not all(r.ok for r in completed):
            return completed
        return await self.session.release_targets([ReleaseSpec(tid, generation)])

    def spawn(self, tid: str, call: Awaitable[list[ItemResult]]) -> None:
        """Run a lifecycle step off the session's event dispatch; the transfer is done for this engine when it is."""

        async def step() -> None:
            try:
                self.check(await call)
            except Exception as err:
                self.failures.append(f"{tid}: {err!r}")
            self.done(tid)

        task = asyncio.create_task(step())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


class NixlDriver(Driver):
    """The data plane too: the SDK's NIXL agents over DRAM move each transfer's blocks (push: the producer WRITEs;
    pull: the consumer READs) and do every lifecycle step; the consumer checks every byte that lands."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from rendezvous.clients.nixl import ConsumerAgent, ProducerAgent

        super().__init__(args)
        self.torch = torch
        self.tensor = torch.zeros((BLOCKS_PER_TRANSFER * self.batch, BLOCK_BYTES), dtype=torch.uint8)
        options: dict[str, Any] = {"layout": LAYOUT, "session_config": self.session_config}
        if args.role == "consumer":
            self.agent: Any = ConsumerAgent(
                self.client, self.engine_id, args.role, [self.tensor], on_result=self.on_result, **options
            )
        else:
            self.agent = ProducerAgent(
                self.client, self.engine_id, args.role, [self.tensor], serve_reads=True, on_report=self.on_report,
                **options,
            )  # fmt: skip
        counted = self.agent.handle_event

        async def handle_event(item: SessionEvent) -> None:
            if isinstance(item, Reregistered):
                self.reregistered += 1
            await counted(item)

        self.agent.handle_event = handle_event
        self.blocks: dict[str, list[int]] = {}

    def content(self, tid: str) -> Any:
        """The bytes transfer tid carries: each block a different value, different from the next transfer's."""
        n = int(tid.rpartition("-")[2])
        values = [(n * BLOCKS_PER_TRANSFER + b) % 251 + 1 for b in range(BLOCKS_PER_TRANSFER)]
        return self.torch.tensor(values, dtype=self.torch.uint8).unsqueeze(1).expand(-1, BLOCK_BYTES)

    async def open(self) -> None:
        await self.agent.start()

    async def shut(self) -> None:
        await self.agent.close()

    async def begin(self, ids: Sequence[str], mode: TransferMode) -> None:
        for slot, tid in enumerate(ids):
            self.blocks[tid] = list(range(slot * BLOCKS_PER_TRANSFER, (slot + 1) * BLOCKS_PER_TRANSFER))
        if self.role == "consumer":
            self.tensor.zero_()
            results = await asyncio.gather(*(self.agent.register_target(t, self.blocks[t], mode=mode) for t in ids))
            self.check(results)
            for result in results:
                if not result.ok:
                    self.done(result.transfer_id)
            return
        for tid in ids:
            self.tensor[self.blocks[tid]] = self.content(tid)
        if mode == TransferMode.PUSH:
            self.check(await asyncio.gather(*(self.agent.claim(t) for t in ids)))
        for tid in ids:
            self.agent.ready(tid, self.blocks[tid], self.done, mode=mode)

    def on_result(self, result: Any) -> None:
        """The consumer: a transfer's bytes are in its blocks (ok), or it failed; the agent releases it."""
        tid = result.transfer_id
        if not result.ok:
            self.done(tid, f"failed: {result.reason} {result.message}")
        elif not self.torch.equal(self.tensor[self.blocks[tid]], self.content(tid)):
            self.done(tid, "the bytes that landed are not the producer's")
        else:
            self.done(tid)

    def on_report(self, report: Any) -> None:
        """The producer: a push write finished (its blocks come back through `ready`'s on_free)."""
        if not report.ok:
            self.failures.append(f"{report.transfer_id}: write failed: {report.error}")


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=("producer", "consumer"), required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--name", default="", help="this process's control files' name (default: the engine id)")
    parser.add_argument("--start", type=int, default=0, help="the first transfer number (an upgraded engine's)")
    parser.add_argument("--prefix", required=True, help="transfer ids are <prefix>-<n>; shared by the two sides")
    parser.add_argument("--targets", required=True, help="the replicas' addresses, comma-separated, in order")
    parser.add_argument("--control", required=True, help="the folder of control and progress files")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--data-plane", choices=("none", "nixl"), default="none", help="move bytes with NIXL")
    args = parser.parse_args(argv)
    asyncio.run((NixlDriver if args.data_plane == "nixl" else SessionDriver)(args).run())


if __name__ == "__main__":
    main(sys.argv[1:])
