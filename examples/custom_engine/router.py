"""A minimal router, and the engines it drives, each in a process of its own.

The router's whole job in push mode: mint a fresh transfer id per request and send the prefill leg and the
decode leg at once. It needs no answer from either engine before sending the other leg: the service matches
the two halves by the transfer id, in whichever order they come. (A production router also picks the engines,
`clients.RouterClient`; here there is one of each.) The legs travel over multiprocessing pipes, standing in
for the engines' own request APIs (HTTP, say). With a binding key (`--auth`) the router signs each request's
transfer to the two engines and sends the binding with both legs, as `kv-rendezvous router --binding-key-file`
does in `kv_transfer_params`.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from rendezvous.clients import Binding, mint_transfer_id
from rendezvous.protocol import bindings

from .decode import DecodeEngine
from .prefill import PrefillEngine

_spawn = multiprocessing.get_context("spawn")
DECODE_ID, PREFILL_ID = "decode-0", "prefill-0"
BINDING_TTL = 600
"""Seconds a binding admits the engines it names (`kv-rendezvous router --binding-ttl`'s default)."""


class EngineProcess:
    """One engine ("prefill" or "decode") in its own process; `send` calls one of its methods there."""

    def __init__(self, kind: str, address: str, engine_id: str, **options: Any) -> None:
        self.kind = kind
        self.connection, theirs = _spawn.Pipe()
        self.process = _spawn.Process(target=_serve, args=(kind, address, engine_id, theirs, options))
        self.process.start()
        theirs.close()

    def send(self, method: str, *args: object) -> None:
        self.connection.send((method, *args))

    def kill(self) -> None:
        """SIGKILL: no goodbye to the service, which learns of it when the engine's lease lapses."""
        assert self.process.pid is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join()

    def stop(self) -> None:
        if self.process.is_alive():
            self.send("stop")
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class Router:
    """Sends each request's two legs; collects the engines' replies, keyed by (what, transfer id)."""

    def __init__(
        self,
        address: str,
        decode_options: dict[str, Any],
        prefill_options: dict[str, Any],
        binding_key: bytes | None = None,
    ) -> None:
        self.binding_key = binding_key
        self.decode = EngineProcess("decode", address, DECODE_ID, **decode_options)
        self.prefill = EngineProcess("prefill", address, PREFILL_ID, **prefill_options)
        self.unread: dict[tuple[str, str], tuple[object, ...]] = {}
        for kind in ("decode", "prefill"):
            self.wait("started", kind)

    def submit(self, prompt: str, *, hold: bool = False, sign: bool = True) -> str:
        """Send a request's two legs; `sign=False` leaves the binding out (a service that requires one refuses)."""
        transfer_id = mint_transfer_id()  # fresh for every request, and for every retry of one
        binding = self.bind(transfer_id) if sign else None
        self.decode.send("request", transfer_id, prompt, binding)
        self.prefill.send("request", transfer_id, prompt, hold, binding)
        return transfer_id

    def bind(self, transfer_id: str) -> Binding | None:
        """The transfer bound to the two engines, for BINDING_TTL seconds; None without a binding key."""
        if self.binding_key is None:
            return None
        expires = int(time.time()) + BINDING_TTL
        return bindings.sign(self.binding_key, transfer_id, DECODE_ID, PREFILL_ID, expires)

    def wait(self, what: str, key: str, timeout: float = 60.0) -> tuple[object, ...]:
        """The reply `(what, key, ...)`, e.g. ("done", transfer_id, ok, reason)."""
        while (what, key) not in self.unread:
            ready = wait([e.connection for e in (self.decode, self.prefill) if e.process.is_alive()], timeout)
            if not ready:
                raise TimeoutError(f"no {what} for {key} within {timeout} s")
            for connection in ready:
                assert isinstance(connection, Connection)
                reply = connection.recv()
                self.unread[(str(reply[0]), str(reply[1]))] = reply
        return self.unread.pop((what, key))

    def pools(self) -> dict[str, int]:
        """Free blocks in each engine's KV pool."""
        self.decode.send("pool")
        self.prefill.send("pool")
        return {kind: int(str(self.wait("pool", kind)[2])) for kind in ("decode", "prefill")}

    def close(self) -> None:
        self.decode.stop()
        self.prefill.stop()


def _serve(kind: str, address: str, engine_id: str, connection: Connection, options: dict[str, Any]) -> None:
    asyncio.run(_serve_async(kind, address, engine_id, connection, options))


async def _serve_async(kind: str, address: str, engine_id: str, connection: Connection, options: Any) -> None:
    """The engine process: start the engine, then run each message as a task on its loop until "stop"."""
    engine = (DecodeEngine if kind == "decode" else PrefillEngine)(address, engine_id, reply=connection.send, **options)
    await engine.start()
    connection.send(("started", kind))
    loop, tasks = asyncio.get_running_loop(), set()
    while True:
        method, *args = await loop.run_in_executor(None, connection.recv)
        if method == "stop":
            break
        task = asyncio.create_task(getattr(engine, method)(*args))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await engine.close()
