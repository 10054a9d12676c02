"""An engine rank in a spawned process: a `ProducerAgent` or `ConsumerAgent` over uint8 KV tensors, driven
over a pipe by the test process, reporting what it is told (results, freed sources, write reports) on a queue.

Source blocks are filled with `pattern(seed, ...)` so the consumer side can be checked byte for byte;
destination memory starts as `SENTINEL`, so a byte that lands where it should not is seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

SENTINEL = 0xA5


@dataclass(frozen=True)
class Spec:
    """What a worker hosts: role "producer" or "consumer", its engine, pool layout and lease."""

    role: str
    address: str
    engine_id: str
    block_lengths: tuple[int, ...] = (1024, 256)
    num_blocks: int = 64
    lease_ttl: float = 0.0

    def worker(self, events: Any) -> Any:
        """What the spawned process runs: an object with async `start` and `close` and one method per command."""
        return _Worker(self, events)


def pattern(seed: int, region: int, count: int, length: int) -> npt.NDArray[np.uint8]:
    """The bytes of `count` source blocks of `region` for transfer seed `seed`."""
    return np.random.default_rng([seed, region]).integers(0, 256, (count, length), dtype=np.uint8)


class _Worker:
    def __init__(self, spec: Spec, events: Any) -> None:
        import torch

        from rendezvous.clients import AsyncRendezvousClient

        self.spec = spec
        self.events = events
        self.tensors = [torch.full((spec.num_blocks, n), SENTINEL, dtype=torch.uint8) for n in spec.block_lengths]
        self.client = AsyncRendezvousClient(spec.address)
        self.agent: Any = None

    async def start(self) -> tuple[str, int, str]:
        from rendezvous.clients.nixl.consumer import ConsumerAgent
        from rendezvous.clients.nixl.producer import ProducerAgent
        from rendezvous.clients.testing import TEST_LAYOUT

        s, put = self.spec, self.events.put
        if s.role == "producer":
            self.agent = ProducerAgent(
                self.client, s.engine_id, "prefill", self.tensors, layout=TEST_LAYOUT, lease_ttl=s.lease_ttl,
                serve_reads=True, on_report=lambda r: put(("report", r.transfer_id, r.generation, r.ok, r.error)),
            )  # fmt: skip
        else:
            self.agent = ConsumerAgent(
                self.client, s.engine_id, "decode", self.tensors, layout=TEST_LAYOUT, lease_ttl=s.lease_ttl,
                on_result=lambda r: put(("result", r.transfer_id, r.generation, r.ok, r.block_ids, r.reason)),
            )  # fmt: skip
        await self.agent.start()
        return self.info()

    def info(self) -> tuple[str, int, str]:
        return self.spec.engine_id, self.agent.session.incarnation, self.agent.agent_name

    # Producer commands

    def fill(self, seed: int, block_ids: list[int]) -> None:
        import torch

        for r, t in enumerate(self.tensors):
            t[block_ids] = torch.from_numpy(pattern(seed, r, len(block_ids), t.shape[1]))

    async def claim(self, transfer_id: str) -> str:
        return _outcome(await self.agent.claim(transfer_id))

    def ready(self, transfer_id: str, block_ids: list[int], pull: bool = False) -> None:
        from rendezvous.clients import TransferMode

        mode = TransferMode.PULL if pull else TransferMode.PUSH
        self.agent.ready(transfer_id, block_ids, lambda t: self.events.put(("free", t)), mode=mode)

    def ready_part(self, transfer_id: str, block_ids: list[int], num_computed_tokens: int, prompt_tokens: int) -> None:
        """The prompt's first `num_computed_tokens` tokens are computed in every layer (chunked prefill)."""
        self.agent.ready_part(
            transfer_id, block_ids, num_computed_tokens, prompt_tokens=prompt_tokens,
            on_free=lambda t: self.events.put(("free", t)),
        )  # fmt: skip

    async def inject(self, transfer_id: str, generation: int, consumer_id: str, dst: list[int]) -> None:
        """Hand the agent an assignment the service did not make (e.g. with block ids out of range)."""
        from rendezvous.clients import Event, EventType, TransferInfo, TransferState

        peer = await self.client.get_engine(consumer_id)
        info = TransferInfo(transfer_id, TransferState.MATCHED, target_block_ids=tuple(dst))
        await self.agent.handle_event(Event(EventType.TRANSFER_ASSIGNED, time.time(), info, generation, peer))

    def writes_in_flight(self) -> int:
        return int(self.agent.writes_in_flight)

    def hang_writer(self) -> None:
        """Have the writer thread stop this process (SIGSTOP, as `WorkerProcess.stop`) the next time it waits for a
        command, between two of its turns: outside any NIXL call. An outside SIGSTOP may land inside one (a poll),
        whose progress goes on after SIGCONT, moving the WRITEs in flight before the writer can look at its fence."""
        writer = self.agent._writer
        commands = writer._commands

        class Hang:
            def put(self, command: Any) -> None:
                commands.put(command)

            def get(self, block: bool = True, timeout: float | None = None) -> Any:
                writer._commands = commands
                os.kill(os.getpid(), signal.SIGSTOP)
                return commands.get(block, timeout)

            def get_nowait(self) -> Any:
                return self.get(False)

        writer._commands = Hang()

    # Consumer commands

    async def register(
        self, transfer_id: str, block_ids: list[int], generation: int = 1, pull: bool = False, progressive: int = 0
    ) -> str:
        """`progressive`: the target's tokens, written in parts (0: one write)."""
        from rendezvous.clients import TransferMode

        mode = TransferMode.PULL if pull else TransferMode.PUSH
        result = await self.agent.register_target(
            transfer_id, block_ids, generation, mode=mode, num_tokens=progressive, progressive=bool(progressive)
        )
        return _outcome(result)

    async def abort(self, transfer_id: str) -> str:
        return _outcome(await self.agent.abort(transfer_id))

    def memory(self) -> list[npt.NDArray[np.uint8]]:
        return [t.numpy().copy() for t in self.tensors]

    def reset(self, block_ids: list[int], value: int = SENTINEL) -> None:
        """Fill the blocks with `value` (the sentinel unless told), as an engine reusing them would write them."""
        for t in self.tensors:
            t[block_ids] = value

    def metric(self, name: str, labels: dict[str, str]) -> float:
        """A sample of this process's default Prometheus registry (where the agent keeps its histograms); 0 if none."""
        from prometheus_client import REGISTRY

        return REGISTRY.get_sample_value(name, labels) or 0.0

    async def close(self) -> None:
        await self.agent.close()
        await self.client.close()


def _outcome(result: Any) -> str:
    return str(result.state.name if result.ok else result.error.reason)


async def _serve(conn: Connection, spec: Spec, events: Any) -> None:
    worker = spec.worker(events)
    loop = asyncio.get_running_loop()
    try:
        conn.send(("ok", await worker.start()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        request = await loop.run_in_executor(None, conn.recv)
        if request is None:
            await worker.close()
            conn.send(("ok", None))
            return
        command, args = request
        try:
            value = getattr(worker, command)(*args)
            if asyncio.iscoroutine(value):
                value = await value
            conn.send(("ok", value))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _main(conn: Connection, spec: Spec, events: Any) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_serve(conn, spec, events))


class WorkerProcess:
    """Parent-side proxy: `call` runs a command in the worker; `expect` waits for one of its reports."""

    def __init__(self, spec: Spec, start_timeout: float = 60.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.spec = spec
        self._conn, child = ctx.Pipe()
        self._events: Any = ctx.Queue()
        self._seen: list[tuple[Any, ...]] = []
        self.process = ctx.Process(target=_main, args=(child, spec, self._events), daemon=True)
        self.process.start()
        child.close()
        self.engine_id, self.incarnation, self.agent_name = self._result(start_timeout)

    def call(self, command: str, *args: Any, timeout: float = 15.0) -> Any:
        self._conn.send((command, args))
        return self._result(timeout)

    def _result(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"worker {self.spec.engine_id} did not answer within {timeout} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"worker {self.spec.engine_id} failed:\n{value}")
        return value

    def expect(self, match: Callable[[tuple[Any, ...]], bool], timeout: float = 10.0) -> tuple[Any, ...]:
        """The first report (seen before or arriving within `timeout`) that `match`es; it is consumed."""
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self._seen):
                if match(event):
                    return self._seen.pop(i)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"worker {self.spec.engine_id}: no matching report; seen {self._seen}")
            try:
                self._seen.append(self._events.get(timeout=remaining))
            except queue.Empty:
                continue

    def result(self, transfer_id: str, timeout: float = 10.0) -> tuple[Any, ...]:
        """A consumer's next result for `transfer_id`: ("result", id, generation, ok, block_ids, reason)."""
        return self.expect(lambda e: e[0] == "result" and e[1] == transfer_id, timeout)

    def freed(self, transfer_id: str, timeout: float = 10.0) -> None:
        """Wait until a producer freed the source of `transfer_id`."""
        self.expect(lambda e: e[0] == "free" and e[1] == transfer_id, timeout)

    def report(self, transfer_id: str, timeout: float = 10.0) -> tuple[Any, ...]:
        """A producer's write report: ("report", id, generation, ok, error)."""
        return self.expect(lambda e: e[0] == "report" and e[1] == transfer_id, timeout)

    def pending(self) -> list[tuple[Any, ...]]:
        """Reports received so far and not consumed (without waiting)."""
        while True:
            try:
                self._seen.append(self._events.get_nowait())
            except queue.Empty:
                return list(self._seen)

    def stop(self) -> None:
        """SIGSTOP: the process hangs (its sockets stay open, nothing of it runs) until `resume`."""
        self._signal(signal.SIGSTOP)

    def stopped(self) -> bool:
        """Whether the process is stopped (by `stop`, or by itself: `hang_writer`)."""
        with open(f"/proc/{self.process.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, signum: signal.Signals) -> None:
        assert self.process.pid is not None
        os.kill(self.process.pid, signum)

    def kill(self) -> None:
        """SIGKILL, as a crashed engine."""
        self.process.kill()
        self.process.join()

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(TimeoutError, RuntimeError, OSError, EOFError):
                self._conn.send(None)
                self._result(15.0)
            self.process.join(5)
        if self.process.is_alive():
            self.kill()
