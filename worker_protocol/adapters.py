"""A worker's LoRA adapters (``--enable-lora``): what both worker kinds do with the adapter a
request names, and the router's load / unload calls.

An adapter is read from disk and checked on the calling thread (a Ray call's), and only then
handed to the engine thread, which holds it between two steps: a load costs the running
batch no disk read. A request naming an adapter this worker does not hold (a worker started
or restarted after the adapter was loaded, or one whose LRU dropped it) loads it the same way
before the request is queued, so every worker serves every adapter the router knows. When
every held adapter (``max_cpu_loras``) has requests running under it, such a load waits
(bounded by the caller's ``wait_s``, ended early by the request's abort) for one of them to
finish, like a request the scheduler defers under ``max_loras``; past the bound it raises
``AdaptersBusyError`` (a QueueFullError: HTTP 429 / RESOURCE_EXHAUSTED), never a failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from engine.lora.request import AdaptersBusyError, LoRARequest

# How often a load that waits for a held adapter to free tries again (s, doubling up to the
# cap): each try is one call onto the engine thread, between two steps.
_BUSY_POLL_S, _BUSY_POLL_MAX_S = 0.005, 0.05


@dataclass(frozen=True)
class LoRALoaded:
    """A worker's answer to ``load_lora``: the adapter it holds now, and ``key``, the root of
    its KV's block hashes (``engine.lora.peft_format.LoRAAdapter.key``): the router keys its
    KV index with it, so one adapter's cached blocks never count for another's prompt."""

    lora_name: str
    lora_int_id: int
    key: int


class WorkerAdapters:
    """The LoRA side of one worker: ``engine`` (its ``LLMEngine``), ``loop`` (its
    ``EngineLoop``), ``timeout_s`` for calls onto the engine thread."""

    def __init__(self, engine, loop, timeout_s: float) -> None:
        self.engine, self.loop, self.timeout_s = engine, loop, timeout_s
        self._lock = threading.Lock()
        self._aborts: dict[str, threading.Event] = {}  # request id -> set by cancel

    @contextmanager
    def abortable(self, request_id: str) -> Iterator[threading.Event]:
        """An event that ``cancel(request_id)`` sets while the block runs (registered here
        under the lock ``cancel`` takes, so no abort from now on is missed): hand it to
        ``ensure`` and check it again after (an abort can land after the load succeeded)."""
        aborted = threading.Event()
        with self._lock:
            self._aborts[request_id] = aborted
        try:
            yield aborted
        finally:
            with self._lock:
                if self._aborts.get(request_id) is aborted:
                    del self._aborts[request_id]

    def cancel(self, request_id: str) -> None:
        """``request_id`` was aborted: its ``abortable`` event is set (a wait gives up)."""
        with self._lock:
            aborted = self._aborts.get(request_id)
        if aborted is not None:
            aborted.set()

    def ensure(self, req: LoRARequest | None, wait_s: float = 0.0,
               aborted: threading.Event | None = None) -> int:
        """Hold ``req``'s adapter (None: the base model, nothing to do); returns its key (0
        for the base model). While every held adapter has requests under it, waits up to
        ``wait_s`` for one to finish; ``aborted`` (the caller's, set by the request's abort)
        ends the wait. The caller registers that event with the request under a lock its abort
        takes (``abortable``, or its own) and checks it again after this returns: an abort can
        land after the load succeeded.
        Raises AdaptersBusyError (still busy, or aborted while waiting), ValueError (LoRA
        off, or the adapter refused)."""
        if req is None:
            return 0
        deadline, delay = time.monotonic() + wait_s, _BUSY_POLL_S
        adapter = self._read(req)
        while True:
            try:
                return self._hold(req, adapter).key
            except AdaptersBusyError:
                left = deadline - time.monotonic()
                if left <= 0 or (aborted is not None and aborted.is_set()):
                    raise
                if adapter is None:  # held when we looked, dropped since: read it once
                    adapter = self.engine.read_lora(req)
                # Each retry is only the engine thread's cheap load of the adapter read above.
                if aborted is not None:
                    aborted.wait(min(delay, left))
                else:
                    time.sleep(min(delay, left))
                delay = min(2 * delay, _BUSY_POLL_MAX_S)

    def load(self, req: LoRARequest) -> LoRALoaded:
        """Read (off the engine thread) and hold ``req``'s adapter; a held one is only
        marked used. ValueError names what is wrong."""
        held = self._hold(req, self._read(req))
        return LoRALoaded(req.lora_name, req.lora_int_id, held.key)

    def _read(self, req: LoRARequest):
        """``req``'s adapter read from disk and checked, on this thread; None when it is
        held already (nothing to read)."""
        reg = self.engine.lora
        if reg is None or req.lora_name not in reg.held_names:
            return self.engine.read_lora(req)  # the disk, on this thread
        return None

    def _hold(self, req: LoRARequest, adapter):
        """Hold ``adapter`` (``_read``'s answer) on the engine thread, between two steps. An
        AdaptersBusyError leaves it untouched (the registry refuses before it keeps or
        ships it), so a retry hands over the same object."""
        return self.loop.call(lambda e: e.load_lora(req, adapter)).result(self.timeout_s)

    def unload(self, name: str) -> bool:
        """Drop adapter ``name``: False if it was not held; ValueError while requests run
        under it here (refused, not deferred)."""
        def drop(e) -> bool:
            try:
                e.remove_lora(name)
            except KeyError:
                return False
            return True

        return self.loop.call(drop).result(self.timeout_s)

    def held(self) -> list[LoRARequest]:
        """The adapters held now, least recently used first."""
        return self.loop.call(lambda e: e.list_loras()).result(self.timeout_s)

    def load_fields(self) -> dict:
        """``WorkerLoad``'s LoRA fields (keyword args; empty when LoRA is off)."""
        return lora_load_fields(self.engine)


def lora_load_fields(engine) -> dict:
    """``WorkerLoad``'s LoRA fields for an ``LLMEngine`` (keyword args; empty when LoRA is
    off). Safe from any thread: the registry swaps what it reads whole."""
    reg = engine.lora
    if reg is None:
        return {}
    return {"lora_adapters": reg.held_names,
            "lora_counts": tuple((n, ld, ev) for n, (ld, ev) in dict(reg.counts).items())}
