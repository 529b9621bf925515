"""The second KV cache tier: prefix-cache blocks evicted from the pool, kept to be restored.

A worker's pool evicts its least recently used cached blocks when a new request needs room;
without a tier their content is gone and the next request with that prefix recomputes it.
``KVTier`` keeps them instead, indexed by the same chained block hashes as the pool's prefix
cache (``engine.core.block_manager``), with their token ids (compared on a hit, like the pool's):

- **host memory** (``memory_bytes``): one preallocated store of whole blocks beside the pool
  (``[slots, layers, 2, block_size, kv_heads, head_dim]``; pinned host memory when the pool
  is on a GPU), least recently used first out. Its size is a hard cap by construction.
- **disk** (optional, ``disk_dir`` + ``disk_bytes``): what host memory evicts, one file per
  block in a directory of this process's own under ``disk_dir``, least recently used first
  out; the bytes on disk never exceed ``disk_bytes``. Each file carries its hash, its token ids
  and a checksum of its KV: a missing, short, corrupt or foreign file is a miss (the entry is
  dropped and the block recomputed), never a crash. ``close`` (and this process's exit)
  removes the directory; a later start on the same host removes directories left by processes
  that no longer run (a killed worker's).

A block is in at most one of the two (host memory is preferred: a disk block evicted from the
pool again moves back to memory). The pool and the tier may both hold a block: one restored
into the pool stays in the tier, so evicting it again costs no copy.

The block manager calls ``offload`` when it evicts a cached block from the pool (before the
block is reused, so its pages still hold the content) and ``restore`` when a prompt's prefix
continues in the tier (before the step that reads it). Both run on the engine thread, between
steps; ``listener`` hears of every block whose tier changed on the tier's own account
(memory -> disk, or dropped), so the worker's KV events stay exact (``engine.core.kv_events``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import struct
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from engine.config import KVTierConfig

_MAGIC = b"PDKV"
_VERSION = 1
# magic, version, block hash, token count, payload bytes, payload checksum
_HEADER = struct.Struct("<4sIQIQQ")
_DIR_PREFIX = "pdcluster-kv-"

Listener = Callable[[int, "str | None"], None]  # (block hash, its tier now or None: gone)


@dataclass(frozen=True)
class TierStats:
    """What the tier holds and did (cumulative counters)."""

    memory_blocks: int
    memory_capacity_blocks: int
    disk_blocks: int
    disk_bytes: int
    disk_capacity_bytes: int
    offloaded_blocks: int  # blocks copied out of the pool
    restored_blocks: int  # blocks copied back into the pool instead of recomputed
    restore_failures: int  # unreadable entries met on a restore (recomputed)
    dropped_blocks: int  # fell out of the last tier


@dataclass
class _Entry:
    token_ids: tuple[int, ...]
    slot: int = -1  # host-memory slot, or -1 when on disk
    path: Path | None = None
    nbytes: int = 0  # bytes of its file on disk


class KVTier:
    """Host-memory (and disk) copies of evicted pool blocks; see the module docstring."""

    def __init__(self, kv_caches: list[torch.Tensor], config: KVTierConfig) -> None:
        if not config.enabled:
            raise ValueError("KVTier needs memory_bytes > 0")
        first = kv_caches[0]  # [num_blocks, 2, block_size, kv_heads, head_dim] per layer
        self._caches = kv_caches
        self._block_shape = (len(kv_caches), *first.shape[1:])  # [layers, 2, bs, h, d]
        self.block_bytes = first[0].numel() * first.element_size() * len(kv_caches)
        slots = config.memory_bytes // self.block_bytes
        if slots < 1:
            raise ValueError(f"--kv-offload-memory {config.memory_bytes} bytes holds no block "
                             f"({self.block_bytes} bytes each)")
        self.config = config
        self._store = torch.empty((slots, *self._block_shape), dtype=first.dtype,
                                  pin_memory=first.is_cuda)
        self._free_slots = list(range(slots - 1, -1, -1))
        self._memory: OrderedDict[int, _Entry] = OrderedDict()  # LRU first
        self._disk: OrderedDict[int, _Entry] = OrderedDict()
        self._disk_used = 0
        self.listener: Listener | None = None
        self.num_offloaded = self.num_restored = self.num_restore_failures = 0
        self.num_dropped = 0
        self.dir: Path | None = None
        if config.disk_dir is not None:
            root = Path(config.disk_dir)
            root.mkdir(parents=True, exist_ok=True)
            _remove_orphans(root)
            self.dir = root / f"{_DIR_PREFIX}{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.dir.mkdir()
            # Removed when the tier is closed, collected, or this process exits normally.
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
            atexit.register(self._cleanup)

    # ---- the block manager's calls ---------------------------------------------------------
    def tier_of(self, block_hash: int, token_ids: tuple[int, ...]) -> str | None:
        """``"host"`` / ``"disk"`` when the tier holds this block (same tokens), else None.
        A hit counts as a use: the block moves to the back of its tier's eviction order, so
        the offloads that making room for its restore causes push other blocks out first."""
        e = self._memory.get(block_hash)
        if e is not None and e.token_ids == token_ids:
            self._memory.move_to_end(block_hash)
            return "host"
        e = self._disk.get(block_hash)
        if e is not None and e.token_ids == token_ids:
            self._disk.move_to_end(block_hash)
            return "disk"
        return None

    def offload(self, block_hash: int, token_ids: tuple[int, ...], block_id: int) -> str | None:
        """The pool evicts ``block_id`` (holding this block): keep a copy. Returns the tier
        that holds it now (``"host"``), or None when it could not be kept."""
        e = self._memory.get(block_hash)
        if e is not None and e.token_ids == token_ids:
            self._memory.move_to_end(block_hash)  # same content: no copy
            return "host"
        self._discard(block_hash)  # a disk copy (it moves to memory) or a foreign entry
        slot = self._take_slot()
        self._store[slot].copy_(self._read_pool(block_id))
        self._memory[block_hash] = _Entry(token_ids, slot)
        self.num_offloaded += 1
        return "host"

    def restore(self, block_hash: int, token_ids: tuple[int, ...], block_id: int) -> bool:
        """Copy the block's KV into pool block ``block_id``. False (entry dropped) when the
        tier does not hold it after all or its file is unreadable: the caller recomputes."""
        e = self._memory.get(block_hash)
        if e is not None and e.token_ids == token_ids:
            self._memory.move_to_end(block_hash)
            self._write_pool(block_id, self._store[e.slot])
            self.num_restored += 1
            return True
        e = self._disk.get(block_hash)
        kv = self._read_file(block_hash, e) if e is not None and e.token_ids == token_ids else None
        if kv is None:
            if e is not None:
                self.num_restore_failures += 1
                self._discard(block_hash)
                self._tell(block_hash, None)
            return False
        self._disk.move_to_end(block_hash)
        self._write_pool(block_id, kv)
        self.num_restored += 1
        return True

    def items(self) -> list[tuple[int, str]]:
        """Every block the tier holds and where (a snapshot for the router)."""
        return ([(h, "host") for h in self._memory] + [(h, "disk") for h in self._disk])

    def stats(self) -> TierStats:
        return TierStats(len(self._memory), self._store.shape[0], len(self._disk),
                         self._disk_used, self.config.disk_bytes, self.num_offloaded,
                         self.num_restored, self.num_restore_failures, self.num_dropped)

    def close(self) -> None:
        """Drop every entry and remove the disk directory (idempotent)."""
        self._memory.clear()
        self._disk.clear()
        self._disk_used = 0
        self._free_slots = list(range(self._store.shape[0] - 1, -1, -1))
        if self.dir is not None:
            self._cleanup()

    def check_invariants(self) -> None:
        """Assert the caps and the bookkeeping hold (used by the random-operation test)."""
        slots = [e.slot for e in self._memory.values()]
        assert len(set(slots)) == len(slots) and not set(slots) & set(self._free_slots)
        assert len(slots) + len(self._free_slots) == self._store.shape[0]
        assert not set(self._memory) & set(self._disk), "a block in memory and on disk"
        assert self._disk_used == sum(e.nbytes for e in self._disk.values())
        assert self._disk_used <= self.config.disk_bytes
        if self.dir is not None:
            on_disk = {p.name for p in self.dir.iterdir()}
            assert on_disk == {e.path.name for e in self._disk.values()}, "stray files"

    # ---- internals -------------------------------------------------------------------------
    def _read_pool(self, block_id: int) -> torch.Tensor:
        """The block's KV from every layer: ``[layers, 2, block_size, kv_heads, head_dim]``."""
        return torch.stack([c[block_id] for c in self._caches])

    def _write_pool(self, block_id: int, kv: torch.Tensor) -> None:
        for layer, cache in enumerate(self._caches):
            cache[block_id].copy_(kv[layer], non_blocking=False)

    def _take_slot(self) -> int:
        """A free host slot, making one by moving the least recently used block on."""
        if not self._free_slots:
            h, e = self._memory.popitem(last=False)
            if self.dir is not None and self._to_disk(h, e):
                self._tell(h, "disk")
            else:
                self.num_dropped += 1
                self._tell(h, None)
            self._free_slots.append(e.slot)
        return self._free_slots.pop()

    def _to_disk(self, block_hash: int, e: _Entry) -> bool:
        payload = self._store[e.slot].contiguous().view(torch.uint8).numpy().tobytes()
        toks = struct.pack(f"<{len(e.token_ids)}I", *e.token_ids)
        nbytes = _HEADER.size + len(toks) + len(payload)
        if nbytes > self.config.disk_bytes:
            return False
        while self._disk_used + nbytes > self.config.disk_bytes:
            old_h, _ = next(iter(self._disk.items()))
            self._discard(old_h)
            self.num_dropped += 1
            self._tell(old_h, None)
        path = self.dir / f"{block_hash:016x}.kv"
        header = _HEADER.pack(_MAGIC, _VERSION, block_hash, len(e.token_ids), len(payload),
                              xxhash.xxh3_64_intdigest(payload))
        try:
            with open(path, "wb") as f:
                f.write(header + toks + payload)
        except OSError:  # a full or failing disk loses the block, not the worker
            path.unlink(missing_ok=True)
            return False
        self._disk[block_hash] = _Entry(e.token_ids, -1, path, nbytes)
        self._disk_used += nbytes
        return True

    def _read_file(self, block_hash: int, e: _Entry) -> torch.Tensor | None:
        """The file's KV, or None when it is not exactly what was written for this block."""
        try:
            data = e.path.read_bytes()
        except OSError:
            return None
        if len(data) != e.nbytes or len(data) < _HEADER.size:
            return None
        magic, version, h, ntok, nbytes, checksum = _HEADER.unpack_from(data)
        start = _HEADER.size + 4 * ntok
        if (magic != _MAGIC or version != _VERSION or h != block_hash
                or ntok != len(e.token_ids) or start + nbytes != len(data)):
            return None
        if struct.unpack_from(f"<{ntok}I", data, _HEADER.size) != e.token_ids:
            return None
        payload = memoryview(data)[start:]
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            return None
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return flat.view(self._store.dtype).view(self._block_shape)

    def _discard(self, block_hash: int) -> None:
        """Forget the block in either tier (freeing its slot or file); no notification."""
        e = self._memory.pop(block_hash, None)
        if e is not None:
            self._free_slots.append(e.slot)
        e = self._disk.pop(block_hash, None)
        if e is not None:
            self._disk_used -= e.nbytes
            e.path.unlink(missing_ok=True)

    def _tell(self, block_hash: int, tier: str | None) -> None:
        if self.listener is not None:
            self.listener(block_hash, tier)


def _host() -> str:
    # No "-": the directory name's fields are "-"-separated.
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname())


def _remove_orphans(root: Path) -> None:
    """Remove this host's tier directories whose process no longer runs (a killed worker
    cannot clean up after itself)."""
    mine = f"{_DIR_PREFIX}{_host()}-"
    for d in root.glob(f"{mine}*"):
        try:
            pid = int(d.name[len(mine):].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
