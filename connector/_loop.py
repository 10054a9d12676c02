"""`LoopThread`: an asyncio event loop on its own daemon thread (the connector's network side).

Kept apart from `rendezvous.connector.rendezvous_connector` so that it imports without vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

_CLEANUP_S = 5.0
"""How long the ending thread waits for cancelled tasks and for the default executor's threads."""


class LoopThread:
    """An asyncio event loop on a daemon thread; other threads hand it callbacks and coroutines.

    `stop()` ends the loop. The thread then cancels the tasks still on it, finalises async generators,
    shuts down the default executor and closes the loop, so neither the loop nor its selector and
    self-pipe outlive the thread.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for its result (start-up and shutdown only)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def call(self, callback: Callable[..., object], *args: Any) -> None:
        """Run callback(*args) on the loop soon; never blocks."""
        self.loop.call_soon_threadsafe(callback, *args)

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop and wait up to timeout seconds for the thread to close it; idempotent."""
        with contextlib.suppress(RuntimeError):  # closed already
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _main(self) -> None:
        loop = self.loop
        try:
            loop.run_forever()
        finally:
            try:
                _cancel_tasks(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(asyncio.wait_for(loop.shutdown_default_executor(), _CLEANUP_S))
            except Exception:
                logger.exception("rendezvous connector: cleaning up the event loop failed")
            finally:
                loop.close()


def _cancel_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the loop's remaining tasks and let them unwind (for at most _CLEANUP_S seconds)."""
    tasks = asyncio.all_tasks(loop)
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.wait(tasks, timeout=_CLEANUP_S))


__all__ = ["LoopThread"]
