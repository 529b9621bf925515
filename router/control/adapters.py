"""The LoRA adapters a router serves (``--enable-lora``): names clients put in ``model``, the
workers that hold each, and the load / unload calls that keep every worker in step.

``AdapterCatalog`` is the orchestrator's. A load reads the adapter on every live worker (prefill
and decode: the prompt's KV is computed with it on one, the tokens on the other) before the
name is served, so no request waits for a disk read; a worker that joins later, or whose LRU
dropped the adapter, loads it when a request first names it (``worker_protocol.adapters``),
and routing counts that load as work (``lora_penalty``). The adapter's key (the root of its
KV's block hashes) comes back from the workers: the router's KV index keys the prompt with it,
so one adapter's cached prefix never draws another adapter's request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.lora.request import LoRARequest
from router.contract import (
    AdapterInUseError,
    InvalidRequestError,
    ModelNotFoundError,
    ServedModel,
)
from router.control.request_state import WorkerSlot, cause_of
from worker_protocol import control

log = logging.getLogger(__name__)


@dataclass
class Adapter:
    """One served adapter: its request (what workers load), its KV hash root, the seconds
    its last load took on a worker (routing's price for a worker that lacks it), and its
    per-adapter traffic (requests started, tokens generated)."""

    request: LoRARequest
    key: int = 0
    load_s: float = 0.0
    requests: int = 0
    tokens: int = 0
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def name(self) -> str:
        return self.request.lora_name


class AdapterCatalog:
    """Adapters by name over the workers ``slots()`` returns. ``enabled``: the workers were
    started with LoRA on (else every load is refused, naming the flag)."""

    def __init__(self, base_model: str, enabled: bool, slots: Callable[[], list[WorkerSlot]],
                 call_timeout_s: float) -> None:
        self.base_model, self.enabled = base_model, enabled
        self.slots, self.call_timeout_s = slots, call_timeout_s
        self._by_name: dict[str, Adapter] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # one load or unload at a time: ids and fan-outs in order

    def resolve(self, model: str | None) -> Adapter | None:
        """The adapter ``model`` names; None for the base model (or no model given).
        ModelNotFoundError for any other name. Counts nothing: a request counts toward its
        adapter's ``pdcluster_lora_requests_total`` once admitted (``admitted``)."""
        if model is None or model == self.base_model:
            return None
        adapter = self._by_name.get(model)
        if adapter is None:
            served = [self.base_model, *self._by_name]
            raise ModelNotFoundError(f"model {model!r} is not served here (serving "
                                     f"{', '.join(repr(m) for m in served)})")
        return adapter

    @staticmethod
    def admitted(adapter: Adapter | None) -> None:
        """A request under ``adapter`` (None: the base model) passed validation and admission
        and runs now: count it (a refused one is not counted)."""
        if adapter is not None:
            adapter.requests += 1

    def adapters(self) -> list[Adapter]:
        """Every served adapter, in load order."""
        return list(self._by_name.values())

    async def load(self, name: str, path: str) -> Adapter:
        """Serve the PEFT adapter at ``path`` as ``name`` once every live worker holds it.
        Raises InvalidRequestError: LoRA off, a bad name, a name served already, or a worker
        refused the adapter (its reason; the workers that took it drop it again)."""
        if not self.enabled:
            raise InvalidRequestError("LoRA adapters are off: start the cluster with "
                                      "--enable-lora")
        if not isinstance(name, str) or not name or name == self.base_model:
            raise InvalidRequestError(f"lora_name must be a non-empty name other than the "
                                      f"base model's ({self.base_model!r}), got {name!r}")
        if not isinstance(path, str) or not path:
            raise InvalidRequestError("lora_path must be a non-empty path")
        async with self._lock:
            if name in self._by_name:
                raise InvalidRequestError(f"LoRA adapter {name!r} is already loaded (from "
                                          f"{self._by_name[name].request.lora_path!r}); "
                                          "unload it first")
            req = LoRARequest(name, next(self._ids), path)
            slots = [s for s in self.slots() if s.view.alive]
            t0 = time.monotonic()
            results = await self._fan_out(slots, "load_lora", req)
            took = time.monotonic() - t0
            failed = [(s, r) for s, r in zip(slots, results, strict=True)
                      if isinstance(r, BaseException)]
            if failed:
                loaded = [s for s, r in zip(slots, results, strict=True)
                          if not isinstance(r, BaseException)]
                await self._fan_out(loaded, "unload_lora", name)
                slot, err = failed[0]
                raise InvalidRequestError(f"{cause_of(err)} (on {slot.info.worker_id})")
            keys = {r.key for r in results}
            if len(keys) > 1:  # the same files read twice must agree: a torn copy otherwise
                await self._fan_out(slots, "unload_lora", name)
                raise InvalidRequestError(f"LoRA adapter {name!r}: workers read different "
                                          f"files at {path!r}")
            adapter = Adapter(req, keys.pop() if keys else 0, took)
            self._by_name[name] = adapter
            log.info("LoRA adapter %s loaded from %s on %d worker(s) in %.2f s", name, path,
                     len(slots), took)
            return adapter

    async def unload(self, name: str) -> None:
        """Stop serving ``name`` and drop it from every worker. ModelNotFoundError if it is
        not served; AdapterInUseError while requests run under it on any worker (refused, not
        deferred: it stays served, and workers that dropped it load it again on use)."""
        async with self._lock:
            if name not in self._by_name:
                raise ModelNotFoundError(f"LoRA adapter {name!r} is not loaded")
            slots = [s for s in self.slots() if s.view.alive]
            results = await self._fan_out(slots, "unload_lora", name)
            refused = [(s, r) for s, r in zip(slots, results, strict=True)
                       if isinstance(r, BaseException)]
            if refused:
                slot, err = refused[0]
                raise AdapterInUseError(f"{cause_of(err)} (on {slot.info.worker_id})")
            del self._by_name[name]
            log.info("LoRA adapter %s unloaded", name)

    def lora_penalty(self, adapter: Adapter | None, slot: WorkerSlot,
                     prefill_rate: Callable[[str], float]) -> float:
        """The prompt tokens' worth of work it costs ``slot`` to serve ``adapter`` first: 0
        when its last report lists it (or no adapter); else the adapter's load time at that
        worker's prefill rate (tokens/s)."""
        if adapter is None:
            return 0.0
        load = slot.view.load
        if load is not None and adapter.name in load.lora_adapters:
            return 0.0
        return adapter.load_s * prefill_rate(slot.info.worker_id)

    async def _fan_out(self, slots: list[WorkerSlot], method: str, arg) -> list:
        """``method(arg)`` on every slot at once (control group), each answer or exception in
        slot order."""
        async def one(slot: WorkerSlot):
            ref = control(getattr(slot.handle, method)).remote(arg)
            return await asyncio.wait_for(ref, self.call_timeout_s)

        return await asyncio.gather(*(one(s) for s in slots), return_exceptions=True)


class AdapterBackend:
    """``GenerationBackend``'s adapter calls for a backend whose ``orchestrator`` owns an
    ``AdapterCatalog`` (``router.cluster.ray_cluster.Cluster``)."""

    def served_models(self) -> list[ServedModel]:
        base = self.model_info().model_id
        return [ServedModel(base), *(ServedModel(a.name, base, a.request.lora_path, a.created,
                                                 a.request.lora_int_id)
                                     for a in self.orchestrator.adapters.adapters())]

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        await self.orchestrator.adapters.load(lora_name, lora_path)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self.orchestrator.adapters.unload(lora_name)
