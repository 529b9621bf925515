"""Rank agents: a worker's own code on every rank of a tensor-parallel engine.

The engine knows nothing of how KV leaves or enters a worker. Under tensor parallelism each
rank holds only its own KV heads, so a transport that moves KV per rank (rather than through
rank 0) needs code on every rank. A worker names a factory (``"module:callable"``, imported
by each follower: the engine imports no transport); ``LLMEngine.attach_rank_agents`` starts
one agent per follower and returns what each reported when ready. Then:

- rank 0 sends agents messages (``LLMEngine.tell_ranks``) in order with the steps;
- a follower hands its agent its own heads of every KV export of a step (``on_export``),
  and tells it when a reservation ends (``on_unreserve``);
- an agent writes arriving KV into its rank's held pages (``FollowerContext.import_kv``)
  and answers rank 0 through the group's store (``FollowerContext.reply``; rank 0 reads
  with ``Replies.wait``).
"""

from __future__ import annotations

import importlib
import threading
import time
from typing import Any, Protocol

import torch

__all__ = ["FollowerContext", "RankAgent", "Replies", "load_agent"]

_POLL_S = 0.002


class RankAgent(Protocol):
    """What a follower calls on its agent (all on the follower's main thread)."""

    def ready(self) -> str:
        """What rank 0 gets back from ``attach_rank_agents`` for this rank (e.g. an address)."""

    def on_tell(self, payload: Any) -> None:
        """One message from rank 0's ``tell_ranks``, in order with the steps."""

    def on_export(self, request_id: str, layer: int, kv: torch.Tensor,
                  heads: tuple[int, int]) -> None:
        """This rank's KV heads ``heads`` of one layer of an exported prompt (a fresh tensor
        the agent owns), during the step that completed the prompt."""

    def on_unreserve(self, request_id: str) -> None:
        """The pages held for the request's arriving KV were given up (admitted or released);
        any later ``import_kv`` for it raises KeyError."""

    def close(self) -> None:
        """End the agent's threads and connections."""


def load_agent(factory: str):
    """The callable named ``"module:callable"``."""
    module, _, name = factory.partition(":")
    return getattr(importlib.import_module(module), name)


class FollowerContext:
    """What an agent on rank > 0 may use: its rank, its heads, its pages, rank 0's ear."""

    def __init__(self, comm, pages) -> None:
        """``pages``: the rank's runner's KV pages (``engine.executor.rank_kv.RankKV``)."""
        self.rank = comm.rank
        self.size = comm.size
        self.heads: tuple[int, int] = pages.own_kv_heads
        self.device = pages.device
        self._pages = pages
        self._store = comm.store
        self._lock = threading.Lock()  # one store client, several agent threads

    def import_kv(self, request_id: str, layer: int, kv: torch.Tensor,
                  heads: tuple[int, int]) -> None:
        """Write one arriving layer (this rank's heads ``heads``) into the pages rank 0
        reserved for the request. Any thread; KeyError once the reservation has ended."""
        self._pages.import_heads(request_id, layer, kv, heads)

    def num_held_pages(self) -> int:
        """Reservations whose pages arriving KV may still write on this rank."""
        return self._pages.num_held

    def reply(self, key: str, value: str) -> None:
        """Answer rank 0's ``Replies.wait(key)``."""
        with self._lock:
            self._store.set(f"agent/{key}/{self.rank}", value)


class Replies:
    """Rank 0's reading of the followers' ``reply``s (any thread)."""

    def __init__(self, store, size: int, alive) -> None:
        self._store = store
        self._size = size
        self._alive = alive  # () -> str | None: a description of a rank that died
        self._lock = threading.Lock()

    def wait(self, key: str, timeout_s: float) -> list[str]:
        """Every follower's answer to ``key`` (rank order), taken off the store. Raises
        TimeoutError after ``timeout_s``, RuntimeError when a rank has died."""
        keys = [f"agent/{key}/{r}" for r in range(1, self._size)]
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._store.check(keys):
                    values = [self._store.get(k).decode() for k in keys]
                    for k in keys:
                        self._store.delete_key(k)
                    return values
            dead = self._alive()
            if dead is not None:
                raise RuntimeError(f"tensor-parallel {dead}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks did not answer {key!r} within "
                                   f"{timeout_s:g} s")
            time.sleep(_POLL_S)

    def discard(self, key: str) -> None:
        """Drop whatever answers to ``key`` arrived (rank 0 stopped waiting for them)."""
        with self._lock:
            for r in range(1, self._size):
                self._store.delete_key(f"agent/{key}/{r}")
