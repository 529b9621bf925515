"""The one OS thread that runs an engine's torch work: building it, then its step loop.

Why one thread: on the CPU, torch's OpenMP runtime (libgomp) keeps a pool of worker threads
per thread that enters a parallel region, and once the pools' threads outnumber the cores it
stops spin-waiting between regions (its "throttled" spin count). An engine built on one thread
(weights, kernel tuning) and stepped on another left two pools behind, and every step paid for
the lost spinning: a 64-token prefill took ~112 ms instead of ~87 ms and a batch-1 decode step
~20% more (2 threads on 2 cores; docs/history/2026-12-04-wave-3-tracing-and-faults.md, "One
thread for an engine's torch work"). So a worker builds its engine with
``ComputeThread.building`` and hands that thread to its ``EngineLoop``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["ComputeThread"]

T = TypeVar("T")


class ComputeThread:
    """A daemon thread running submitted callables one at a time, in order. ``close`` ends
    it once the callables already submitted have run (the one running is not interrupted)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def building(cls, name: str, factory: Callable[[], T]) -> tuple[ComputeThread, T]:
        """A new thread named ``name`` and what ``factory()`` returned, run on it (an engine,
        built where it will be stepped). What the factory raised is raised here, the thread
        closed."""
        thread = cls(name)
        try:
            return thread, thread.run(factory)
        except BaseException:
            thread.close()
            raise

    def submit(self, fn: Callable[[], T]) -> Future:
        """Run ``fn()`` on this thread after what was submitted before; its future."""
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on this thread and return its result, or raise what it raised."""
        return self.submit(fn).result()

    def close(self) -> None:
        self._jobs.put(None)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # the caller's to see, through the future
                fut.set_exception(e)
