"""Run coroutines on one long-lived asyncio loop from synchronous tests (no pytest-asyncio),
and poll a condition with a deadline."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def wait_until(pred: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition",
               poll_s: float = 0.05) -> None:
    """Poll ``pred`` until it holds; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"{what} not met within {timeout_s} s"
        time.sleep(poll_s)


def run_cluster(loop: LoopThread, config, body, timeout_s: float = 300.0):
    """Start a ``router.cluster.ray_cluster.Cluster`` of ``config`` on ``loop``, return ``await
    body(cluster)``, and shut the cluster down on every path."""
    from router.cluster.ray_cluster import Cluster

    async def go():
        cluster = await Cluster.start(config)
        try:
            return await body(cluster)
        finally:
            await cluster.shutdown()
    return loop.run(go(), timeout_s=timeout_s)


@contextmanager
def ray_loop(**ray_init_kw) -> Iterator[LoopThread]:
    """A local Ray (``start_local_ray(**ray_init_kw)``, no dashboard, no driver logs) and a
    ``LoopThread`` for a test module's clusters; both shut down afterwards."""
    import ray

    from router.cluster.local_ray import start_local_ray
    from tests.helpers.shared_ray import stop_shared_ray

    stop_shared_ray()  # a Ray of the caller's own settings: the shared one makes way
    start_local_ray(include_dashboard=False, log_to_driver=False, **ray_init_kw)
    lt = LoopThread()
    try:
        yield lt
    finally:
        lt.close()
        ray.shutdown()


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


async def assert_no_blocks_held(cluster, timeout_s: float = 10.0) -> None:
    """Wait until no worker of ``cluster`` holds a KV block (used or reserved); fail after
    ``timeout_s`` naming who holds what."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        loads = await cluster.worker_loads()
        held = {lo.worker_id: (lo.kv_blocks_used, lo.kv_blocks_reserved) for lo in loads
                if lo.kv_blocks_used or lo.kv_blocks_reserved}
        if not held:
            return
        assert time.monotonic() < deadline, f"KV blocks still held (used, reserved): {held}"
        await asyncio.sleep(0.1)


async def until(ok, what: str, timeout_s: float = 10.0) -> None:
    """Await ``ok()`` until it returns true; AssertionError naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def generate_tokens(cluster, params, prompt: list[int], rid: str) -> list[int]:
    """One request through ``cluster``'s backend contract: every token it streamed."""
    from router.contract import GenerateInput

    toks: list[int] = []
    async for ch in cluster.generate(GenerateInput(params, token_ids=prompt, request_id=rid)):
        toks += ch.token_ids
    return toks
