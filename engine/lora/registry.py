"""``LoRARegistry``: the adapters one engine holds, by name.

An adapter is read from disk when it is first named (``load``), checked against the base model
then, and kept in host memory; at most ``max_cpu_loras`` are kept, the least recently used one
that no unfinished request runs under giving way to a new one. (On the CPU an adapter's tensors
serve the step from where they are: "resident" and "in host memory" are the same place, so
``max_loras`` is enforced where it matters, by the scheduler: at most that many adapters in one
running batch.) An adapter in use is never unloaded: ``unload`` refuses it, naming how many
requests still run under it.

Under tensor parallelism (``tell`` given: rank 0) each rank holds its own shard of every
adapter (``engine.lora.peft_format.lay_out``). Rank 0 reads and checks the adapter, and tells
the other ranks every change in the order it happens: ``("lora_load", PeftTensors)`` (the
tensors it read, so every rank lays out the same bytes) and ``("lora_drop", name)`` (an
unload or an LRU eviction). A follower's registry applies them with ``follow``, so every
rank holds the same adapters before any step names them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from engine.lora.peft_format import LoRAAdapter, lay_out, read_peft
from engine.lora.request import AdaptersBusyError, LoRARequest
from engine.lora.rows import forget_groupings
from engine.models.config import ModelConfig
from engine.parallel.sharding import TPShard

__all__ = ["AdaptersBusyError", "LoRARegistry"]


class LoRARegistry:
    """Adapters by name for a base model of ``cfg``. ``in_use(name)``: how many unfinished
    requests run under an adapter (the engine's scheduler knows). ``shard``: the
    tensor-parallel rank whose shard of each adapter is held (``cfg`` stays the whole
    model's); ``tell``: rank 0's channel to the other ranks (``RankKV.tell``)."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None = None, dtype: torch.dtype = torch.float32,
                 in_use: Callable[[str], int] = lambda name: 0,
                 shard: TPShard | None = None,
                 tell: Callable[[tuple], None] | None = None) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
        cpu = max_loras if max_cpu_loras is None else max_cpu_loras
        if cpu < max_loras:
            raise ValueError(f"max_cpu_loras ({cpu}) must be >= max_loras ({max_loras})")
        self.cfg, self.max_loras, self.max_lora_rank, self.max_cpu_loras = (
            cfg, max_loras, max_lora_rank, cpu)
        self.dtype = dtype
        self.in_use = in_use
        self.shard, self.tell = shard, tell
        self._held: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.num_loads = self.num_evictions = 0
        # Per adapter name, cumulative: (loads, evictions) for the per-adapter metrics. And
        # the held names as one tuple, swapped whole on every change, for readers on other
        # threads (a worker's load report) that must not iterate the dict mid-change.
        self.counts: dict[str, tuple[int, int]] = {}
        self.held_names: tuple[str, ...] = ()

    def read(self, req: LoRARequest) -> LoRAAdapter:
        """``req``'s adapter read from disk and checked (ValueError with the reason), not
        held: touches no state, so a worker reads off its engine thread and hands the result
        to ``load`` (a running batch waits for no disk)."""
        peft = read_peft(req, self.cfg, self.max_lora_rank)
        adapter = lay_out(peft, self.cfg, self.dtype, self.shard)
        if self.tell is not None:  # shipped to the other ranks when it is held
            adapter.source = peft
        return adapter

    def load(self, req: LoRARequest, adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        """The adapter ``req`` names, read now if it is not held (then checked: ValueError
        with the reason), or ``adapter`` (``read``'s answer for ``req``) when given. A name
        already held must come with the same path and id; an id held under another name is
        refused."""
        held = self._held.get(req.lora_name)
        if held is not None:
            if held.request != req:
                raise ValueError(f"LoRA adapter {req.lora_name!r} is loaded from "
                                 f"{held.request.lora_path!r} with id "
                                 f"{held.request.lora_int_id}; unload it before loading "
                                 f"{req.lora_path!r} (id {req.lora_int_id}) under that name")
            self._held.move_to_end(req.lora_name)
            self.held_names = tuple(self._held)
            return held
        for other in self._held.values():
            if other.request.lora_int_id == req.lora_int_id:
                raise ValueError(f"lora_int_id {req.lora_int_id} is taken by adapter "
                                 f"{other.name!r}")
        if (adapter is None or adapter.request != req
                or (self.tell is not None and adapter.source is None)):
            adapter = self.read(req)
        while len(self._held) >= self.max_cpu_loras:
            victim = next((n for n in self._held if not self.in_use(n)), None)
            if victim is None:
                raise AdaptersBusyError(f"cannot load LoRA adapter {req.lora_name!r}: all "
                                 f"{self.max_cpu_loras} held adapters (max_cpu_loras) have "
                                 "requests running under them")
            del self._held[victim]
            forget_groupings()  # no remembered step grouping keeps the victim alive
            if self.tell is not None:
                self.tell(("lora_drop", victim))
            self.num_evictions += 1
            loads, evictions = self.counts.get(victim, (0, 0))
            self.counts[victim] = (loads, evictions + 1)
        self._held[req.lora_name] = adapter
        if self.tell is not None:  # shipped once; the message holds it until it is sent
            self.tell(("lora_load", adapter.source))
            adapter.source = None
        self.num_loads += 1
        loads, evictions = self.counts.get(req.lora_name, (0, 0))
        self.counts[req.lora_name] = (loads + 1, evictions)
        self.held_names = tuple(self._held)
        return adapter

    def get(self, name: str) -> LoRAAdapter:
        """The held adapter ``name`` (KeyError if it is not held)."""
        return self._held[name]

    def unload(self, name: str) -> None:
        """Drop adapter ``name``. Raises KeyError if it is not held, ValueError while
        requests run under it (refused, not deferred: the caller may retry)."""
        if name not in self._held:
            raise KeyError(f"LoRA adapter {name!r} is not loaded")
        n = self.in_use(name)
        if n:
            raise ValueError(f"LoRA adapter {name!r} is in use by {n} request(s); unload "
                             "refused")
        del self._held[name]
        forget_groupings()  # no remembered step grouping keeps it alive
        if self.tell is not None:
            self.tell(("lora_drop", name))
        self.held_names = tuple(self._held)

    def follow(self, msg: tuple) -> None:
        """A follower rank: apply rank 0's ``("lora_load", PeftTensors)`` (this rank's shard
        laid out and held) or ``("lora_drop", name)``."""
        kind, what = msg
        if kind == "lora_load":
            self.load(what.request, lay_out(what, self.cfg, self.dtype, self.shard))
        elif kind == "lora_drop":
            self.unload(what)
        else:
            raise RuntimeError(f"unknown LoRA message {kind!r}")

    def names(self) -> list[str]:
        """Held adapters, least recently used first."""
        return list(self._held)

    def held(self) -> list[LoRAAdapter]:
        return list(self._held.values())
