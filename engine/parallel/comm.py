"""The collectives of one tensor-parallel group, as the sharded model and the step protocol
use them: sum across ranks, gather logits, send rank 0's step to the others.

Each group is its own pair of process groups over its own TCP store (no
``torch.distributed`` default group): several engines, tensor-parallel or not, can live in
one process (tests, an embedded server beside a worker). Tensors go over NCCL on CUDA and gloo
on the CPU; control messages (pickled objects) always over gloo.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.parallel.sharding import TPShard
from engine.parallel.shm import ShmAllReduce

__all__ = ["TPComm", "TPStoreAddress", "host_shm", "host_store", "wait_for_ranks"]

# Joining waits this long for every rank (model loading happens before, not during); a
# collective's own timeout is long because a follower waits in one between requests.
_JOIN_TIMEOUT = datetime.timedelta(seconds=120)
_OP_TIMEOUT = datetime.timedelta(days=1)
# CPU all-reduces up to this size go through shared memory (a decode step's are a few KB; a
# 2048-token prefill chunk of a 576-wide model is 4.7 MB and takes gloo, where a millisecond
# is small beside the chunk's compute).
SHM_SLOT_BYTES = 4 << 20
_SHM_KEY = "pdcluster/shm"
_ARRIVED_KEY = "pdcluster/arrived/{rank}"  # a rank is up and about to join


@dataclass(frozen=True)
class TPStoreAddress:
    """Where the group's ranks meet (rank 0's TCP store)."""

    host: str
    port: int


def host_store(size: int, host: str = "127.0.0.1") -> tuple[dist.TCPStore, TPStoreAddress]:
    """Rank 0's store on a free port of ``host``."""
    store = dist.TCPStore(host, 0, size, True, timeout=_JOIN_TIMEOUT, wait_for_workers=False)
    return store, TPStoreAddress(host, store.port)


def wait_for_ranks(store: dist.TCPStore, size: int, exited: Callable[[], str | None]) -> None:
    """Rank 0, before it joins: wait until every other rank has arrived (started, imported,
    connected), checking ``exited()`` (a description of a rank that died, or None) as it
    waits, so a rank that dies on its way fails start-up at once instead of after the join's
    timeout. Raises RuntimeError."""
    keys = [_ARRIVED_KEY.format(rank=r) for r in range(1, size)]
    deadline = time.monotonic() + _JOIN_TIMEOUT.total_seconds()
    while not store.check(keys):
        dead = exited()
        if dead is not None:
            raise RuntimeError(f"tensor-parallel {dead} before joining its group "
                               "(its log says why)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not start within "
                               f"{_JOIN_TIMEOUT.total_seconds():.0f} s")
        time.sleep(0.05)


def host_shm(store: dist.TCPStore, size: int) -> ShmAllReduce:
    """Rank 0 of a CPU group: the shared segment its ranks all-reduce through, named in the
    store for the others. The caller owns it (``close`` removes it)."""
    shm = ShmAllReduce.create(size, SHM_SLOT_BYTES)
    store.set(_SHM_KEY, shm.name)
    return shm


class TPComm:
    """One rank's end of its group. Every rank must call the same collectives in the same
    order (the step protocol in ``engine.parallel.ranks`` guarantees it); a rank that fails or
    exits makes the others' next collective raise."""

    def __init__(self, shard: TPShard, address: TPStoreAddress, device: torch.device,
                 store: dist.TCPStore | None = None, shm: ShmAllReduce | None = None) -> None:
        """Rank 0 passes its ``store`` (and on the CPU its ``host_shm``); the others
        connect to ``address`` and attach to the segment it names."""
        self.shard = shard
        self.device = device
        if store is None:
            store = dist.TCPStore(address.host, address.port, shard.size, False,
                                  timeout=_JOIN_TIMEOUT)
        self._store = store
        if shm is None and device.type == "cpu" and shard.rank != 0:
            shm = ShmAllReduce.attach(store.get(_SHM_KEY).decode(), shard.rank, shard.size,
                                      SHM_SLOT_BYTES)
        self.shm = shm
        if shard.rank != 0:
            store.set(_ARRIVED_KEY.format(rank=shard.rank), "1")
        ctrl = dist.PrefixStore("ctrl", store)
        self._ctrl = dist.ProcessGroupGloo(ctrl, shard.rank, shard.size, _OP_TIMEOUT)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL works on the current device: this rank's
            opts = dist.ProcessGroupNCCL.Options()
            self._tensors = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), shard.rank,
                                                  shard.size, opts)
        else:
            self._tensors = self._ctrl

    @property
    def store(self) -> dist.TCPStore:
        """The group's store (rank agents answer rank 0 through it: engine.parallel.agents)."""
        return self._store

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` across ranks, in place; returns it. The same shapes on every rank pick
        the same path (shared memory or the process group)."""
        if self.shm is not None and self.shm.fits(t):
            return self.shm.all_reduce(t)
        self._tensors.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``t`` (same shape on each) joined along ``dim``, in rank order."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._tensors.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (others pass nothing). Tensors inside travel
        pickled, on the CPU."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._ctrl.broadcast([size]).wait()
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._ctrl.broadcast([data]).wait()
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())
