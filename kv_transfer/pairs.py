"""Pairwise process groups: one 2-rank gloo/NCCL group per (prefill, decode) pair.

Owns building a pair's group over a PrefixStore, closing it on purpose (which wakes every
blocked wait on both sides), and the per-worker cache of live pairs with the stall watchdog.
``kv_transfer.sender`` and ``kv_transfer.receiver`` build on this.

NCCL error handling is chosen on purpose: a pair's group waits forever (the receiver always
has a header receive posted, even on an idle pair, and deadlines are enforced in Python), and
``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` makes an NCCL error abort that communicator only. Torch's
default (3) tears the whole process down, so one cut link would take a worker and every
request on it with it. The heartbeat monitor, which kills a process whose NCCL watchdog looks
stuck, is off for the same reason. An operator's own setting of either variable wins.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kv_transfer.protocol import KILL_TAG, KVLayout

FOREVER = datetime.timedelta(days=7)  # a data wait must never be what closes a pair
# See the module docstring: an NCCL error aborts the pair's communicator, never the process.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}


def gen_key(p: str) -> str:
    return f"kv/{p}/gen"


def store_key(p: str, g: int, what: str) -> str:
    return f"kv/{p}/{g}/{what}"


@dataclass
class Pair:
    """One generation of the 2-rank group with one peer."""

    peer_id: str
    gen: int
    pg: object
    peer_rank: int
    store: dist.Store  # a private client connection the group was built on
    # KV heads each layer message on this pair carries (fixed by the two ends' ranks: the
    # handshake computes it, ``kv_transfer.routes.pair_heads``); 0 on the sending side.
    num_heads: int = 0
    dead: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def build_group(store: dist.Store, prefill_id: str, decode_id: str, gen: int, rank: int,
                 device: torch.device, local_host: str, timeout_s: float) -> object:
    """The pair's 2-rank group (rank 0 = decode, rank 1 = prefill); gloo binds ``local_host``.
    NCCL bootstraps over the interface named by NCCL_SOCKET_IFNAME (set at worker start)."""
    prefix = dist.PrefixStore(f"pair/{prefill_id}/{decode_id}/{gen}", store)
    timeout = datetime.timedelta(seconds=max(timeout_s, 0.1))
    if device.type == "cuda":
        for name, value in NCCL_ENV.items():
            os.environ.setdefault(name, value)  # read when the group is built
        opts = dist.ProcessGroupNCCL.Options()
        # The watchdog must never time a wait out: an idle pair always has a receive posted.
        opts._timeout = FOREVER
        return dist.ProcessGroupNCCL(prefix, rank, 2, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # Bind to the address this worker advertises, never gloo's default (the machine's
    # hostname, which inside a container or network namespace resolves to an address other
    # hosts cannot reach, or to none at all).
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    return dist.ProcessGroupGloo(prefix, rank, 2, opts)


def kill_pair(pair: Pair, device: torch.device) -> None:
    """Close the pair's connection: wakes every blocked wait on both sides with an error."""
    if device.type == "cuda":
        pair.pg.abort()
        return
    try:
        work = pair.pg.recv([torch.empty(1)], pair.peer_rank, KILL_TAG)
        work.wait(datetime.timedelta(milliseconds=1))
    except RuntimeError:
        pass  # expected: the timeout is what closes the pair


class PairOwner:
    """Shared by both sides: the cached pairs, discarding them, and the stall watchdog."""

    def __init__(self, worker_id: str, layout: KVLayout, device: str | torch.device,
                 timeout_s: float) -> None:
        self.worker_id = worker_id
        self.layout = layout
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pairs: dict[str, Pair] = {}
        self._peer_locks: dict[str, threading.Lock] = {}
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_loop, daemon=True,
                                          name=f"kv-watchdog-{worker_id}")
        self._watchdog.start()

    def live_pairs(self) -> dict[str, int]:
        """Peer id -> generation of the live group with it (operators, failure tests)."""
        with self._lock:
            return {p.peer_id: p.gen for p in self._pairs.values() if not p.dead}

    def _peer_lock(self, peer_id: str) -> threading.Lock:
        with self._lock:
            return self._peer_locks.setdefault(peer_id, threading.Lock())

    def _discard(self, pair: Pair, retire_store: dist.Store | None) -> None:
        """Retire the pair (the peer then builds a new generation) and close its connection."""
        with pair.lock:
            if pair.dead:
                return
            pair.dead = True
        with self._lock:
            if self._pairs.get(pair.peer_id) is pair:
                del self._pairs[pair.peer_id]
        if retire_store is not None:
            try:
                p = pair.peer_id if pair.peer_rank == 1 else self.worker_id
                retire_store.set(store_key(p, pair.gen, "retired"), "1")
            except RuntimeError:
                pass  # the store may be gone with its host; the closed pair says enough
        kill_pair(pair, self.device)

    def _discard_gen(self, peer_id: str, gen: int | None) -> None:
        """Discard the pair with ``peer_id`` if it is still generation ``gen`` (a transfer
        stuck on it: a newer generation is left alone)."""
        with self._lock:
            pair = self._pairs.get(peer_id)
        if pair is not None and pair.gen == gen:
            self._discard(pair, self._control_store(pair))

    def _control_store(self, pair: Pair) -> dist.Store | None:
        return None

    def _check_stalls(self, now: float) -> None:
        """Fail transfers that stopped making progress (the receiver overrides this)."""

    def _watch_loop(self) -> None:
        while not self._closed.wait(0.2):
            self._check_stalls(time.monotonic())

    def _close_pairs(self) -> None:
        self._closed.set()
        with self._lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            self._discard(pair, self._control_store(pair))
        self._watchdog.join()
