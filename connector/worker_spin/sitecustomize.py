"""Shorten vLLM's shared-memory spin in engines started by `rendezvous.connector.launch` (tests, benchmarks, demos).

A vLLM worker waits for its next step on a shared-memory queue (`shm_broadcast.MessageQueue`), and after each
read it busy-polls it for 1 s (`SpinCondition.busy_loop_s`, not configurable) before it sleeps on a socket. On a
host with fewer cores than busy processes, two engines' workers spinning between steps took a core and a half
of two at 1 request/s, which the other engine, the connectors' threads and the network then lacked. With
KV_RENDEZVOUS_WORKER_SPIN_MS set, readers spin that long instead, then sleep on vLLM's notification socket in
slices of that length, looking at the queue between slices. The slices matter: that socket sometimes misses a
write (a reader that sleeps on it indefinitely stalled for up to vLLM's 5 s recheck: TTFT p99 9.9 s on a plain
engine at 4 requests/s), which vLLM's 1 s of spinning hides.

Python imports this module at start-up when its folder is on PYTHONPATH (`rendezvous.connector.launch` puts it there);
it only installs an import hook, which patches the queue's module when vLLM imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

SPIN_ENV = "KV_RENDEZVOUS_WORKER_SPIN_MS"
_MODULE = "vllm.distributed.device_communicators.shm_broadcast"


class _PatchSpin(importlib.abc.MetaPathFinder):
    """Finds vLLM's shm_broadcast module as usual, then shortens `SpinCondition`'s busy loop and slices its sleep
    once it is loaded."""

    def __init__(self, spin_s: float) -> None:
        self.spin_s = spin_s

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        spin_s = self.spin_s

        def exec_module(module: ModuleType) -> None:
            run(module)
            condition = getattr(module, "SpinCondition", None)
            if condition is None:  # another vLLM: leave it as it is
                return
            init, wait = condition.__init__, condition.wait
            slice_ms = max(1, round(spin_s * 1e3))

            def shorter(self: Any, *args: Any, **kwargs: Any) -> None:
                init(self, *args, **kwargs)
                self.busy_loop_s = min(self.busy_loop_s, spin_s)

            def sliced(self: Any, timeout_ms: int | None = None) -> None:
                wait(self, timeout_ms=slice_ms if timeout_ms is None else min(timeout_ms, slice_ms))

            condition.__init__ = shorter
            condition.wait = sliced

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _install() -> None:
    value = os.environ.get(SPIN_ENV, "")
    if value:
        sys.meta_path.insert(0, _PatchSpin(float(value) / 1e3))


_install()
