"""All-reduce through shared memory, for tensor-parallel ranks on one host's CPUs.

gloo's all-reduce crosses loopback TCP: about a millisecond each on a 2-core box, and a
decode step makes two per layer (60 for the default model), which cost more than the step's
arithmetic. Here each rank copies its tensor into its own slot of one shared segment, raises
its flag, waits until every rank's flag is up, and sums the slots in rank order (so every rank
gets bitwise the same sum, as a collective must). Two slots per rank, used alternately: a
rank can write call k+1 while a slower one still reads call k, and cannot reach call k+2
before every rank has finished reading call k (it waits for their flags of k+1, raised only
after they read k).

The wait spins (a rank is one thread on its own core; a sleep would cost more than the
wait), yielding the CPU now and then, and checks ``alive()`` so that rank 0 stops waiting for
a rank that died. Tensors larger than a slot go through the caller's fallback.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

__all__ = ["ShmAllReduce"]

_FLAG_BYTES = 64  # one cache line per rank's flag: no false sharing between spinning ranks
_SPINS_BEFORE_YIELD = 2000
_ALIVE_EVERY_S = 0.1


class ShmAllReduce:
    """One group's shared segment: ``size`` ranks x 2 slots of ``slot_bytes`` + flags.
    Rank 0 creates it (``create``); the others attach by name (``attach``)."""

    def __init__(self, shm: shared_memory.SharedMemory, rank: int, size: int,
                 slot_bytes: int, owner: bool) -> None:
        self._shm, self.rank, self.size = shm, rank, size
        self.slot_bytes, self._owner = slot_bytes, owner
        self._flags = np.ndarray((size, _FLAG_BYTES // 8), dtype=np.int64, buffer=shm.buf)
        self._data = shm.buf[size * _FLAG_BYTES:]
        self._calls = 0
        self.alive: Callable[[], bool] = lambda: True

    @staticmethod
    def _bytes(size: int, slot_bytes: int) -> int:
        return size * _FLAG_BYTES + size * 2 * slot_bytes

    @classmethod
    def create(cls, size: int, slot_bytes: int) -> ShmAllReduce:
        shm = shared_memory.SharedMemory(create=True, size=cls._bytes(size, slot_bytes))
        shm.buf[:size * _FLAG_BYTES] = bytes(size * _FLAG_BYTES)
        return cls(shm, 0, size, slot_bytes, owner=True)

    @classmethod
    def attach(cls, name: str, rank: int, size: int, slot_bytes: int) -> ShmAllReduce:
        shm = shared_memory.SharedMemory(name=name)
        # Rank 0 owns the segment: this process's resource tracker must not unlink it when
        # this process exits (the default for a segment it merely opened, before 3.13).
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
        return cls(shm, rank, size, slot_bytes, owner=False)

    @property
    def name(self) -> str:
        return self._shm.name

    def fits(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.numel() * t.element_size() <= self.slot_bytes

    def _slot(self, rank: int, parity: int, t: torch.Tensor) -> torch.Tensor:
        start = (rank * 2 + parity) * self.slot_bytes
        raw = self._data[start:start + t.numel() * t.element_size()]
        return torch.frombuffer(raw, dtype=t.dtype).view(t.shape)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` across ranks in place (rank order: the same bits everywhere)."""
        self._calls += 1
        k, parity = self._calls, self._calls % 2
        self._slot(self.rank, parity, t).copy_(t)
        self._flags[self.rank, 0] = k  # after the copy: x86 keeps stores in order
        self._wait(k)
        t.copy_(self._slot(0, parity, t))
        for r in range(1, self.size):
            t.add_(self._slot(r, parity, t))
        return t

    def _wait(self, k: int) -> None:
        flags = self._flags
        spins = 0
        checked = time.monotonic()
        while int(flags[:, 0].min()) < k:
            spins += 1
            if spins >= _SPINS_BEFORE_YIELD:
                os.sched_yield()
                now = time.monotonic()
                if now - checked > _ALIVE_EVERY_S:
                    checked = now
                    if not self.alive():
                        raise RuntimeError("a tensor-parallel rank exited")

    def close(self) -> None:
        """Detach; the owner also removes the segment."""
        self._flags = None
        try:
            self._data.release()
            self._shm.close()
        except BufferError:  # a slot view still alive: the mapping goes with the process
            pass
        if self._owner:
            self._shm.unlink()
