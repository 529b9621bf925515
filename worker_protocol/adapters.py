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
        self._waits: dict[str, threading.Event] = {}  # request id -> set by its abort

    def ensure(self, req: LoRARequest | None, wait_s: float = 0.0, request_id: str = "") -> int:
        """Hold ``req``'s adapter (None: the base model, nothing to do); returns its key (0
        for the base model). While every held adapter has requests under it, waits up to
        ``wait_s`` for one to finish (``cancel(request_id)`` ends the wait). Raises
        AdaptersBusyError (still busy), ValueError (LoRA off, or the adapter refused)."""
        if req is None:
            return 0
        deadline, delay = time.monotonic() + wait_s, _BUSY_POLL_S
        cancelled = threading.Event()
        if request_id:
            self._waits[request_id] = cancelled
        try:
            while True:
                try:
                    return self.load(req).key
                except AdaptersBusyError:
                    left = deadline - time.monotonic()
                    if left <= 0 or cancelled.is_set():
                        raise
                    cancelled.wait(min(delay, left))
                    delay = min(2 * delay, _BUSY_POLL_MAX_S)
        finally:
            if request_id:
                self._waits.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """``request_id`` was aborted: a load waiting for it gives up now."""
        ev = self._waits.get(request_id)
        if ev is not None:
            ev.set()

    def load(self, req: LoRARequest) -> LoRALoaded:
        """Read (off the engine thread) and hold ``req``'s adapter; a held one is only
        marked used. ValueError names what is wrong."""
        reg = self.engine.lora
        adapter = None
        if reg is None or req.lora_name not in reg.held_names:
            adapter = self.engine.read_lora(req)  # the disk, on this thread
        held = self.loop.call(lambda e: e.load_lora(req, adapter)).result(self.timeout_s)
        return LoRALoaded(req.lora_name, req.lora_int_id, held.key)

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
