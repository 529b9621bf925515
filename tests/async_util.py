"""Run coroutines on one long-lived asyncio loop from synchronous tests (no pytest-asyncio)."""

from __future__ import annotations

import asyncio
import threading


class LoopThread:
    """An asyncio loop on a daemon thread; ``run(coro)`` blocks for the result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="test-loop")
        self._thread.start()

    def run(self, coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def submit(self, coro):
        """Start ``coro`` on the loop without waiting; returns a concurrent Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
