"""The other ranks of a tensor-parallel engine: rank 0 (the engine's own process, which owns
the scheduler and samples) starts ranks 1..N-1 as processes of their own (the follower module
its builder names: ``engine.runtime.tp_follower``), sends each step to them and ends them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from engine.parallel.agents import Replies
from engine.parallel.comm import TPComm, TPStoreAddress, host_shm, host_store, wait_for_ranks
from engine.parallel.sharding import TPShard

__all__ = ["FollowerSpec", "TPRanks", "rank_device", "rank_threads"]

_END_GRACE_S = 5.0


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: GPU r on CUDA (one GPU per rank), the CPU otherwise."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


def rank_threads(num_threads: int | None, size: int) -> int:
    """Intra-op threads per rank: the engine's setting, or the host's cores shared out."""
    return num_threads or max(1, (os.cpu_count() or 1) // size)


@dataclass(frozen=True)
class FollowerSpec:
    """What a follower process is started with (as JSON on its command line)."""

    args: dict  # EngineArgs' fields
    rank: int
    size: int
    address: TPStoreAddress
    parent_pid: int

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FollowerSpec:
        raw = json.loads(text)
        return cls(raw["args"], raw["rank"], raw["size"], TPStoreAddress(**raw["address"]),
                   raw["parent_pid"])


def _end(procs: list[subprocess.Popen], shm) -> None:
    """SIGTERM every follower, then SIGKILL what is left after the grace period; remove the
    shared segment."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + _END_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if shm is not None:
        shm.close()


class TPRanks:
    """Rank 0's handle on its group: ``comm`` is rank 0's end; the follower processes are
    ended by ``close``, when this object is collected, or at interpreter exit."""

    def __init__(self, args: Any, device: torch.device, follower_module: str) -> None:
        """``args``: the engine's EngineArgs (the followers are started with the same);
        ``follower_module``: what each follower runs (``python -m <module> <FollowerSpec>``)."""
        size = args.tensor_parallel_size
        store, address = host_store(size)
        shm = host_shm(store, size) if device.type == "cpu" else None
        procs: list[subprocess.Popen] = []
        self.procs = procs
        self._finalizer = weakref.finalize(self, _end, procs, shm)
        try:
            for rank in range(1, size):
                spec = FollowerSpec(dataclasses.asdict(args), rank, size, address, os.getpid())
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", follower_module, spec.to_json()]))
            wait_for_ranks(store, size, self._exited)
            self.comm = TPComm(TPShard(0, size), address, device, store, shm)
            if shm is not None:  # stop waiting in an all-reduce for a rank that died
                shm.alive = lambda: all(p.poll() is None for p in procs)
            self.replies = Replies(store, size, self._exited)
        except BaseException:
            self.close()
            raise

    def _exited(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return f"rank {rank} (pid {p.pid}) exited with code {p.returncode}"
        return None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self, max_len: int, num_blocks: int) -> None:
        """Tell the followers how to size their model and KV pool; they then serve steps."""
        self.comm.broadcast(("init", max_len, num_blocks))

    def close(self) -> None:
        self._finalizer()
