"""The health port: grpc.health.v1 alone, answered from threads of its own, never from the serving loop.

Every RendezvousService call runs on the server's event loop; a call that holds it (a long batch, a slow
conversion) would delay a health check served there too, and a liveness probe that times out restarts the
pod. `HealthPort` serves the statuses from a synchronous `grpc.server` on its own thread pool, so it
answers whatever the loop is doing; the loop only sets the statuses (`grpc_health`'s synchronous servicer
is thread-safe). The serving port keeps a health service of its own, on the loop: probes should target
this port (docs/deploy.md).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2_grpc

_THREADS = 4
"""Threads answering health calls: Check answers at once and Watch holds none (it is non-blocking), so open
Watch streams never keep a probe's Check waiting (no cap on calls in progress either, for the same reason)."""


class HealthPort:
    """A plaintext grpc.health.v1-only server on `address`. `start()` binds it and returns the port."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="health")
        self._servicer = health.HealthServicer(experimental_non_blocking=True, experimental_thread_pool=self._pool)
        self._server = grpc.server(self._pool)
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, self._server)

    def start(self) -> int:
        """Bind and serve; the port bound (OSError if none)."""
        port: int = self._server.add_insecure_port(self._address)
        if not port:
            raise OSError(f"cannot listen on {self._address}")
        self._server.start()
        return port

    def set(self, service: str, status: int) -> None:
        """Set a service's status (from any thread; Watch streams hear of it)."""
        self._servicer.set(service, status)

    def stop(self) -> None:
        """Stop serving at once and release the threads."""
        self._server.stop(None).wait()
        self._pool.shutdown(wait=False)
