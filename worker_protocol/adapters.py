"""A worker's LoRA adapters (``--enable-lora``): what both worker kinds do with the adapter a
request names, and the router's load / unload calls.

An adapter is read from disk and checked on the calling thread (a Ray call's), and only then
handed to the engine thread, which holds it between two steps: a load costs the running
batch no disk read. A request naming an adapter this worker does not hold (a worker started
or restarted after the adapter was loaded, or one whose LRU dropped it) loads it the same way
before the request is queued, so every worker serves every adapter the router knows.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.lora.request import LoRARequest


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

    def ensure(self, req: LoRARequest | None) -> int:
        """Hold ``req``'s adapter (None: the base model, nothing to do); returns its key (0
        for the base model). Raises ValueError when LoRA is off or the adapter is refused."""
        if req is None:
            return 0
        return self.load(req).key

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
