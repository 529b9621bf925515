"""A runner's KV pages read and written as whole-model layers, whatever its tensor parallelism.

KV crosses workers in the model's whole layout (every KV head), whatever either side's tensor
parallelism: a TP engine's ranks gather their heads on export and each takes its own on import,
so any prefill TP size pairs with any decode TP size. Under tensor parallelism rank 0 also
queues what the other ranks must apply before its next step (their heads of imported KV,
reservations, rank agents' messages) and sends it ahead of each broadcast; the other ranks
hold the pages reserved for KV arriving per rank (``engine.parallel.agents``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from engine.attention.backend import for_pool, gather_kv
from engine.config import cdiv
from engine.models.llama import LlamaForCausalLM
from engine.parallel.sharding import TPShard

# One read of a request's KV after a layer: (request id, block ids, tokens, start).
KVRead = tuple[str, list[int], int, int]
# A follower's hand-off of its own heads of one read: (request id, layer, kv, heads).
ShardExport = Callable[[str, int, torch.Tensor, tuple[int, int]], None]


class RankKV:
    """The KV pages of one rank's runner (``kv_caches``: one
    ``[num_pages, 2, block_size, kv_heads, head_dim]`` per layer, this rank's KV heads), read
    and written as whole-model layers; ``model``'s ``comm`` is the tensor-parallel group
    (None: one rank), its ``shard`` and ``full_cfg`` say which heads this rank holds."""

    def __init__(self, kv_caches: list[torch.Tensor], block_size: int, device: torch.device,
                 model: LlamaForCausalLM) -> None:
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.tp = model.comm  # None: one rank
        self._writes_lock = threading.Lock()
        if self.tp is not None:
            shard, full = model.shard, model.full_cfg
            mine = shard.kv_heads(full)
            self._my_heads = slice(mine.start, mine.stop)  # of the model's KV heads
            # The gathered heads come rank by rank; a replicated head is taken from the first
            # rank that holds it.
            # Ranks may hold different numbers of heads (an uneven split): each pads its own to
            # the most any holds, so the gather's parts are alike.
            held = [TPShard(r, shard.size).kv_heads(full) for r in range(shard.size)]
            self._gather_heads = shard.max_kv_heads(full)
            sources = []
            for h in range(full.num_kv_heads):
                r = next(r for r in range(shard.size) if h in held[r])
                sources.append(r * self._gather_heads + h - held[r].start)
            self._head_sources = torch.tensor(sources, device=device)
            self._pending_writes: list = []
            # Control messages for the other ranks, sent ahead of rank 0's next broadcast
            # (``tell``); on the other ranks, the pages reserved for arriving KV (``hold``).
            self._ctl: list = []
            self._held: dict[str, tuple[list[int], int]] = {}
        self.own_kv_heads = ((self._my_heads.start, self._my_heads.stop) if self.tp is not None
                             else (0, model.cfg.num_kv_heads))

    def read_layer_kv(self, layer: int, block_ids: list[int], num_tokens: int,
                      start: int = 0, gather: bool = True) -> torch.Tensor:
        """One layer's KV of a request's positions ``[start, num_tokens)``, token-contiguous:
        ``[2, num_tokens - start, kv_heads, head_dim]`` with every KV head of the model, as the
        pool stores it (an int8 pool: its rows of ``head_dim + 4`` bytes, scales included).
        Under tensor parallelism every rank calls it (in the same order: the heads are
        all-gathered), on the engine's thread; ``gather=False``: this rank's own heads
        (``own_kv_heads``), no collective."""
        bs = self.block_size
        first, nb = start // bs, cdiv(num_tokens, bs)
        # Gather only the pages that hold [start, num_tokens), then drop the rows before start.
        k, v = gather_kv(self.kv_caches[layer],
                         torch.tensor(block_ids[first:nb], device=self.device),
                         num_tokens - first * bs)
        skip = start - first * bs
        kv = torch.stack([k[skip:], v[skip:]]) if skip else torch.stack([k, v])
        if self.tp is None or not gather:
            return kv
        if kv.shape[2] < self._gather_heads:
            kv = torch.nn.functional.pad(kv, (0, 0, 0, self._gather_heads - kv.shape[2]))
        heads = self.tp.all_gather(kv, dim=2)  # [2, T, ranks x padded heads, D], rank order
        return heads.index_select(2, self._head_sources)

    def write_layer_kv(self, layer: int, block_ids: list[int], kv: torch.Tensor,
                       start: int = 0, heads: tuple[int, int] | None = None) -> None:
        """Scatter ``[2, num_tokens, kv_heads, head_dim]`` (every KV head of the model; values,
        or int8 rows, converted to the pool's format where they differ) into
        this runner's own pages at positions ``[start, start + num_tokens)``. Any thread.
        Under tensor parallelism rank 0 writes its heads now and queues the other ranks'
        (sent, on the engine's thread, ahead of the next step). ``heads``: ``kv`` holds only
        the model's KV heads ``[lo, hi)``, all of them this rank's (KV that arrived per rank):
        written here alone, nothing queued."""
        if heads is not None:
            self._write_own(layer, block_ids, kv, start, heads)
            return
        if self.tp is None:
            self._write_heads(layer, block_ids, kv, start)
            return
        self._write_heads(layer, block_ids, kv[:, :, self._my_heads], start)
        with self._writes_lock:
            self._pending_writes.append((layer, block_ids, kv, start))

    def _write_own(self, layer: int, block_ids: list[int], kv: torch.Tensor, start: int,
                   heads: tuple[int, int]) -> None:
        lo, hi = self.own_kv_heads
        if not lo <= heads[0] < heads[1] <= hi or kv.shape[2] != heads[1] - heads[0]:
            raise ValueError(f"KV of heads {heads[0]}..{heads[1] - 1} ({kv.shape[2]} in the "
                             f"tensor) cannot land on a rank holding {lo}..{hi - 1}")
        self._write_heads(layer, block_ids, kv, start, slice(heads[0] - lo, heads[1] - lo))

    def _write_heads(self, layer: int, block_ids: list[int], kv: torch.Tensor,
                     start: int, into: slice = slice(None)) -> None:
        n = kv.shape[1]
        bs = self.block_size
        pos = torch.arange(start, start + n, device=self.device)
        blocks = torch.tensor(block_ids, dtype=torch.int64, device=self.device)[pos // bs]
        cache = self.kv_caches[layer]
        kv = for_pool(cache, kv)
        cache[blocks, 0, pos % bs, into] = kv[0]
        cache[blocks, 1, pos % bs, into] = kv[1]

    # ---- rank 0's messages to the other ranks --------------------------------------------
    # Every broadcast is (control messages, main message): the control messages queued since
    # the last one (imported KV, reservations, agent messages) go first, in order, so a
    # follower has taken them before it runs any later step that depends on them.
    def tell(self, msg: tuple) -> None:
        """Rank 0, any thread: queue a control message for the other ranks (sent ahead of
        the next broadcast, or by ``flush_ranks``)."""
        with self._writes_lock:
            self._ctl.append(msg)

    def flush_ranks(self) -> None:
        """Rank 0, engine thread: send what is queued for the other ranks now (a step
        would send it anyway; this is for messages that must not wait for one)."""
        if self.tp is None:
            return
        with self._writes_lock:
            pending = bool(self._ctl or self._pending_writes)
        if pending:
            self.broadcast(None)

    def broadcast(self, main: tuple | None) -> None:
        """Rank 0, engine thread: send ``main`` (a step, or None) to the other ranks, after
        everything queued for them."""
        with self._writes_lock:
            writes, self._pending_writes = self._pending_writes, []
            ctl, self._ctl = self._ctl, []
        if writes:
            # Pickled through the control group: host tensors (a GPU tensor would unpickle
            # onto rank 0's device in the other ranks).
            ctl.insert(0, ("kv_writes", [(layer, block_ids, kv.cpu(), start)
                                         for layer, block_ids, kv, start in writes]))
        self.tp.broadcast((ctl, main))

    # ---- the other ranks: their share of imported KV, pages for KV arriving per rank -----
    def follow_kv_writes(self, writes: list) -> None:
        """Rank > 0's share of imported KV: its own heads of each queued write."""
        for layer, block_ids, kv, start in writes:
            self._write_heads(layer, block_ids, kv[:, :, self._my_heads], start)

    def hold_pages(self, request_id: str, block_ids: list[int], start: int) -> None:
        """Rank > 0: rank 0 reserved these pages for ``request_id``'s arriving KV (its
        positions from ``start`` on); ``import_heads`` may write them until ``drop_pages``."""
        with self._writes_lock:
            self._held[request_id] = (block_ids, start)

    def drop_pages(self, request_id: str) -> None:
        """Rank > 0: the reservation ended (admitted, released): no late layer lands in its
        pages once this returns, before any later step can reuse them."""
        with self._writes_lock:
            self._held.pop(request_id, None)

    @property
    def num_held(self) -> int:
        """Rank > 0: reservations whose pages arriving KV may still write."""
        with self._writes_lock:
            return len(self._held)

    def import_heads(self, request_id: str, layer: int, kv: torch.Tensor,
                     heads: tuple[int, int]) -> None:
        """Rank > 0, any thread: write one arriving layer of this rank's heads into the
        pages held for ``request_id``. KeyError when the reservation has ended."""
        with self._writes_lock:  # ordered against drop_pages
            held = self._held.get(request_id)
            if held is None:
                raise KeyError(f"no reservation for {request_id!r} on rank {self.tp.rank}")
            block_ids, start = held
            self._write_own(layer, block_ids, kv, start, heads)
