"""bench_nixl's agent modes: what the NIXL SDK's reports cost on the path, with a real service and NIXL.

A `kv-rendezvous serve --store memory` process on loopback, and the engines' rank agents (`ProducerAgent`,
`ConsumerAgent`, each with its own client) in this process on one event loop, over UCX on loopback; one-block
transfers of 256 bytes, so what is timed is the coordination, not the bytes.

  pull-read    `--only-pull-read`: sequential one-block pull transfers (decode READs prefill's block). Per
               transfer, READ end -> result (the consumer's `arrival_to_result` with via "read": since 531ecc0 the
               result waits for the service to take the READ's report) and ready -> result (prefill's `ready` to
               decode's `TransferResult`).
  source-hold  `--only-source-hold`: sequential one-block push transfers. Per transfer, write end -> on_free
               (`WriteReport.written_time` to prefill's `on_free`: since b5fad27 a written source is kept until
               its report is answered), the report's round trip (written -> answered) and ready -> on_free.
  pull-commit  `--only-pull-commit`: `--at-once` pull transfers at once from a prefill of two ranks into a decode of
               two ranks (default `follower_check_s`), each rank reading its share and reporting it; the last report
               commits. Per transfer, commit -> release: from the committing CompleteTransfers' answer (state
               COMMITTED) reaching decode to decode's rank 0 sending ReleaseTargets for it; since f37a389 and
               daaf2e6 the service tells decode of a commit its other rank cannot see and rank 0 releases on that,
               before it asked GetTransfer every `follower_check_s` (5 s). Also split by the rank whose report
               committed (rank 0 releases what its own report committed at once), the GetTransfers decode sent, and
               first ready -> every transfer released.

The instruments are the client's calls (a subclass of `AsyncRendezvousClient` stamping answers) and the agents'
public callbacks and histograms, so the same script runs against older builds (a worktree at another commit).
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from bench_rendezvous import start_server
from prometheus_client import CollectorRegistry

from rendezvous.clients import (
    AsyncRendezvousClient,
    ClientConfig,
    CompletionSpec,
    ItemResult,
    KvLayout,
    ReleaseSpec,
    TransferInfo,
    TransferMode,
    TransferState,
)
from rendezvous.clients.nixl.consumer import ConsumerAgent, TransferResult
from rendezvous.clients.nixl.metrics import DataPlaneMetrics
from rendezvous.clients.nixl.producer import ProducerAgent, WriteReport
from rendezvous.clients.nixl.rank import start_ranks

BLOCKS, BLOCK_BYTES = 8, 256
LAYOUT = KvLayout("bench", "uint8", 16, 1)
TP2 = KvLayout("bench", "uint8", 16, 1, tp_size=2, kv_layout="HND", num_kv_heads=2)
WARMUP = 20
"""Transfers run first and not counted (first contact: peer metadata, descriptor lists, the channels)."""
MUST = 60.0
"""Seconds to wait for what must happen, however loaded the machine; only a broken build waits that long."""


class TimedClient(AsyncRendezvousClient):
    """A client that tells `stamp` when its engine's CompleteTransfers answers say a transfer COMMITTED ("committed",
    transfer id) and when it sends ReleaseTargets ("released", transfer id); keeps the transfers its reports
    committed, and counts its GetTransfer calls."""

    def __init__(self, config: ClientConfig, stamp: Callable[[str, str], None]) -> None:
        super().__init__(config)
        self.stamp = stamp
        self.commits: list[str] = []
        self.get_transfers = 0

    async def complete_transfers(
        self,
        engine_id: str,
        completions: Sequence[CompletionSpec],
        *,
        incarnation: int = 0,
        timeout: float | None = None,
    ) -> list[ItemResult]:
        results = await super().complete_transfers(engine_id, completions, incarnation=incarnation, timeout=timeout)
        for completion, result in zip(completions, results, strict=True):
            if result.ok and result.state is TransferState.COMMITTED:
                self.stamp("committed", completion.transfer_id)
                self.commits.append(completion.transfer_id)
        return results

    async def release_targets(
        self, engine_id: str, releases: Sequence[ReleaseSpec], *, incarnation: int = 0, timeout: float | None = None
    ) -> list[ItemResult]:
        for release in releases:
            self.stamp("released", release.transfer_id)
        return await super().release_targets(engine_id, releases, incarnation=incarnation, timeout=timeout)

    async def get_transfer(self, transfer_id: str, *, timeout: float | None = None) -> TransferInfo:
        self.get_transfers += 1
        return await super().get_transfer(transfer_id, timeout=timeout)


class ResultTimes(DataPlaneMetrics):
    """The consumer's data-plane histograms, keeping each arrival -> result observation too."""

    def __init__(self) -> None:
        super().__init__(CollectorRegistry())
        self.samples: dict[str, list[float]] = {}

    def observe_result(self, rank: int, via: str, seconds: float) -> None:
        super().observe_result(rank, via, seconds)
        self.samples.setdefault(via, []).append(seconds)


@dataclass
class Waits:
    """Futures the benchmark awaits, resolved from the agents' callbacks (on the loop), by transfer id."""

    futures: dict[tuple[str, str], asyncio.Future[float]] = field(default_factory=dict)

    def of(self, kind: str, transfer_id: str) -> asyncio.Future[float]:
        key = (kind, transfer_id)
        if key not in self.futures:
            self.futures[key] = asyncio.get_running_loop().create_future()
        return self.futures[key]

    def stamp(self, kind: str, transfer_id: str) -> None:
        future = self.of(kind, transfer_id)
        if not future.done():
            future.set_result(time.monotonic())

    def result(self, result: TransferResult) -> None:
        """A consumer's `on_result`: "ok" or "failed"."""
        self.stamp("ok" if result.ok else "failed", result.transfer_id)

    async def time(self, kind: str, transfer_id: str) -> float:
        return await asyncio.wait_for(self.of(kind, transfer_id), MUST)


@asynccontextmanager
async def service() -> AsyncIterator[ClientConfig]:
    """A memory-store server in its own process; the config of a client of it."""
    proc, address = start_server("memory")
    try:
        yield ClientConfig(targets=(address,))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def kv(fill: int, blocks: int = BLOCKS) -> list[torch.Tensor]:
    return [torch.full((blocks, BLOCK_BYTES), fill, dtype=torch.uint8)]


def spread(values: list[float]) -> dict[str, float]:
    """Milliseconds: p50, p90, p99, mean, min, max of seconds."""
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return {
        "p50_ms": at(0.5),
        "p90_ms": at(0.9),
        "p99_ms": at(0.99),
        "mean_ms": statistics.fmean(values) * 1e3,
        "min_ms": ordered[0] * 1e3,
        "max_ms": ordered[-1] * 1e3,
        "n": len(values),
    }


async def _pull_read(count: int) -> dict[str, Any]:
    waits = Waits()
    times = ResultTimes()
    async with (
        service() as config,
        AsyncRendezvousClient(config) as prefill_client,
        AsyncRendezvousClient(config) as decode_client,
    ):
        producer = ProducerAgent(prefill_client, "p0", "prefill", kv(1), layout=LAYOUT, serve_reads=True)
        consumer = ConsumerAgent(
            decode_client, "d0", "decode", kv(0), layout=LAYOUT,
            on_result=waits.result,
        )  # fmt: skip
        consumer.metrics = times
        await producer.start()
        await consumer.start()
        try:
            ready_to_result = []
            for i in range(WARMUP + count):
                transfer_id, block = f"t{i}", i % BLOCKS
                assert (await consumer.register_target(transfer_id, [block], mode=TransferMode.PULL)).ok
                assert (await producer.claim(transfer_id)).ok
                start = time.monotonic()
                producer.ready(transfer_id, [block], lambda t: waits.stamp("free", t), mode=TransferMode.PULL)
                result = await waits.time("ok", transfer_id)
                await waits.time("free", transfer_id)  # committed: the source is prefill's again
                ready_to_result.append(result - start)
        finally:
            await consumer.close()
            await producer.close()
    return {
        "transfers": count,
        "read_to_result": spread(times.samples["read"][WARMUP:]),
        "ready_to_result": spread(ready_to_result[WARMUP:]),
    }


async def _source_hold(count: int) -> dict[str, Any]:
    waits = Waits()
    reports: dict[str, WriteReport] = {}

    def on_report(report: WriteReport) -> None:
        reports[report.transfer_id] = report
        waits.stamp("report", report.transfer_id)

    async with (
        service() as config,
        AsyncRendezvousClient(config) as prefill_client,
        AsyncRendezvousClient(config) as decode_client,
    ):
        producer = ProducerAgent(prefill_client, "p0", "prefill", kv(1), layout=LAYOUT, on_report=on_report)
        consumer = ConsumerAgent(
            decode_client, "d0", "decode", kv(0), layout=LAYOUT,
            on_result=waits.result,
        )  # fmt: skip
        await producer.start()
        await consumer.start()
        try:
            hold, report_trip, ready_to_free = [], [], []
            for i in range(WARMUP + count):
                transfer_id, block = f"t{i}", i % BLOCKS
                assert (await consumer.register_target(transfer_id, [block])).ok
                assert (await producer.claim(transfer_id)).ok
                start = time.monotonic()
                producer.ready(transfer_id, [block], lambda t: waits.stamp("free", t))
                freed = await waits.time("free", transfer_id)
                await waits.time("report", transfer_id)
                await waits.time("ok", transfer_id)
                report = reports.pop(transfer_id)
                assert report.ok, report
                hold.append(freed - report.written_time)
                report_trip.append(report.completed_time - report.written_time)
                ready_to_free.append(freed - start)
        finally:
            await consumer.close()
            await producer.close()
    return {
        "transfers": count,
        "write_end_to_free": spread(hold[WARMUP:]),
        "write_end_to_report_answered": spread(report_trip[WARMUP:]),
        "ready_to_free": spread(ready_to_free[WARMUP:]),
    }


async def _pull_commit(at_once: int) -> dict[str, Any]:
    waits = Waits()
    results: list[Waits] = [Waits(), Waits()]
    async with service() as config, AsyncRendezvousClient(config) as prefill_client:
        clients = [TimedClient(config, waits.stamp) for _ in range(2)]
        producers = [
            ProducerAgent(prefill_client, "p0", "prefill", kv(1 + r, at_once), layout=TP2, rank=r, serve_reads=True)
            for r in range(2)
        ]
        consumers = [
            ConsumerAgent(
                clients[r], "d0", "decode", kv(0, at_once), layout=TP2, rank=r,
                on_result=results[r].result,
            )
            for r in range(2)
        ]  # fmt: skip
        await start_ranks(producers)
        await start_ranks(consumers)
        try:
            ids = [f"t{i}" for i in range(at_once)]
            for consumer in consumers:
                registered = await asyncio.gather(
                    *(consumer.register_target(t, [i], mode=TransferMode.PULL) for i, t in enumerate(ids))
                )
                assert all(r.ok for r in registered), registered
            assert all(r.ok for r in await asyncio.gather(*(producers[0].claim(t) for t in ids)))
            start = time.monotonic()
            for i, transfer_id in enumerate(ids):
                producers[0].ready(transfer_id, [i], mode=TransferMode.PULL)
            for rank in results:
                for transfer_id in ids:
                    await rank.time("ok", transfer_id)
            committed = {t: await waits.time("committed", t) for t in ids}
            released = {t: await waits.time("released", t) for t in ids}  # rank 0 releases in the background
            get_transfers = sum(c.get_transfers for c in clients)
        finally:
            for consumer in reversed(consumers):
                await consumer.close()
            for producer in reversed(producers):
                await producer.close()
            for client in clients:
                await client.close()
    return {
        "transfers": at_once,
        "commit_to_release": spread([released[t] - committed[t] for t in ids]),
        **{
            f"commit_to_release_by_rank{r}": spread([released[t] - committed[t] for t in c.commits])
            for r, c in enumerate(clients)
            if c.commits
        },
        "get_transfers": get_transfers,
        "ready_to_all_released_s": max(released.values()) - start,
    }


def pull_read(count: int) -> dict[str, Any]:
    return asyncio.run(_pull_read(count))


def source_hold(count: int) -> dict[str, Any]:
    return asyncio.run(_source_hold(count))


def pull_commit(at_once: int) -> dict[str, Any]:
    return asyncio.run(_pull_commit(at_once))
