"""A worker's KV endpoints on every tensor-parallel rank: KV over per-(prefill rank, decode
rank) pairs.

Each rank of a worker owns one endpoint: rank 0 (the worker's process) its own, here; every
other rank one in its agent (``worker_protocol.kv_rank_agent.RankKVAgent``, started through
``engine.parallel.agents``). A
transfer is split into routes (``kv_transfer.routes``): prefill rank ``i`` sends the KV heads
decode rank ``j`` takes from it, over the pair ``(i, j)``, layer by layer as at TP 1, with the
same wire format; the pair's handshake carries both ranks' TP size and heads. At TP 1 on both
sides there is one route, rank 0 to rank 0, and this is exactly the TP 1 transfer.

Rank 0 decides, the other ranks act and answer (``FollowerContext.reply``):

- decode (``DecodeRankKV``): at reserve, ``announce`` (engine thread, with the reservation)
  tells every rank the transfer and the prefill worker's TP size; each posts its routes'
  receives and answers ``exp/<rid>``; ``expect`` posts rank 0's and waits for those answers.
  Each rank then answers ``done/<rid>`` when its routes arrived (or failed); ``wait`` waits
  for rank 0's own, then theirs. A reservation that ends (admitted or released) ends every
  rank's expectation and page hold before any later step runs (``on_unreserve``).
- prefill (``PrefillRankKV``): ``announce`` (engine thread, with the request) tells the
  ranks the transfer and the decode ranks' addresses; every rank sends its routes as the step
  exports its heads; ``finish`` waits for rank 0's routes, then the ranks' ``sent/<rid>``;
  ``abort_ranks`` (engine thread) tells them to drop it.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass

import torch

from engine.runtime.llm_engine import LLMEngine
from kv_transfer import (
    KVHandshakeError,
    KVLayout,
    KVTransferError,
    KVTransferSpec,
    KVTransferTimeout,
    PeerAddress,
    TorchDistReceiver,
    TorchDistSender,
)
from kv_transfer.routes import KVRoute, kv_routes, rank_peer_id, route_spec
from worker_protocol.kv_rank_agent import (
    RankKVConfig,
    answer_key,
    own_routes,
    route_piece,
)

__all__ = ["AGENT", "DecodeRankKV", "PrefillRankKV", "rank_state"]

AGENT = "worker_protocol.kv_rank_agent:RankKVAgent"
_ANSWER_S = 30.0  # a follower answers an announcement within this (it only posts receives)


def _raise_answers(answers: list[str], what: str) -> None:
    """Re-raise the first follower error among ``answers`` as the KV error it was."""
    for rank, a in enumerate(answers, start=1):
        if a.startswith("err:"):
            _, kind, msg = a.split(":", 2)
            cls = KVHandshakeError if kind == "handshake" else KVTransferError
            raise cls(f"{what} on tensor-parallel rank {rank}: {msg}")


def _await_ranks(engine: LLMEngine, key: str, deadline: float, what: str) -> None:
    """Until every other rank answered ``key`` "ok" (nothing to wait for at TP 1). Raises
    KVTransferTimeout past ``deadline``, KVTransferError when a rank died, and a rank's own
    error as KVHandshakeError / KVTransferError."""
    if engine.tp_size == 1:
        return
    try:
        answers = engine.rank_replies(key, max(deadline - time.monotonic(), 0.0))
    except TimeoutError as e:
        raise KVTransferTimeout(f"{what}: {e}") from None
    except RuntimeError as e:
        raise KVTransferError(f"{what}: {e}") from None
    _raise_answers(answers, what)


def _route_bytes(spec: KVTransferSpec, route: KVRoute) -> int:
    """What one route of ``spec`` moves: every layer of its heads."""
    layout = spec.layout
    return (2 * spec.num_tokens * route.num_heads * layout.row_width
            * layout.element_bytes * layout.num_layers)


# ---- rank 0 --------------------------------------------------------------------------------
@dataclass
class _Transfer:
    """Rank 0's part of one transfer: its routes' specs (and, sending, where each goes), and
    what every rank will have moved once it is through."""

    spec: KVTransferSpec
    routes: list[KVTransferSpec]
    rank_bytes: list[int]
    targets: list[tuple[KVRoute, PeerAddress]] = dataclasses.field(default_factory=list)


def rank_state(loop, engine: LLMEngine) -> list[dict]:
    """What each other rank still holds for transfers (``held_pages``: reservations whose
    pages arriving KV may write; ``expected`` / ``sending``: transfers in flight), rank order:
    all zero on an idle worker, or something leaked. ``loop``: the worker's EngineLoop."""
    loop.call(lambda e: e.tell_ranks(("state",), now=True)).result(_ANSWER_S)
    return [json.loads(a) for a in engine.rank_replies("state", _ANSWER_S)]


def _config(role: str, worker_id: str, layout: KVLayout, host: str, transport: str,
            timeout_s: float, stream_layers: bool = True) -> dict:
    return dataclasses.asdict(RankKVConfig(role, worker_id, dataclasses.asdict(layout), host,
                                           transport, timeout_s, stream_layers))


class DecodeRankKV:
    """Rank 0 of a decode worker: its own receiver, and the other ranks' through their agents."""

    def __init__(self, engine: LLMEngine, worker_id: str, layout: KVLayout, host: str,
                 transport: str, device: str | torch.device, timeout_s: float) -> None:
        self.engine = engine
        self.layout = layout
        self.timeout_s = timeout_s
        self.receiver = TorchDistReceiver(worker_id, layout, host=host, device=device,
                                          timeout_s=timeout_s, tp_size=engine.tp_size, tp_rank=0)
        try:
            ready = engine.attach_rank_agents(AGENT, _config("decode", worker_id, layout, host,
                                                             transport, timeout_s))
        except BaseException:
            self.receiver.close()
            raise
        # Where each rank receives: rank 0's first (routes name decode ranks by index).
        self.addresses = (self.receiver.address,
                          *(PeerAddress(**json.loads(a)) for a in ready))
        self._routes: dict[str, _Transfer] = {}  # request id -> rank 0's routes
        self.rank_bytes = [0] * engine.tp_size  # received per rank (transfers completed)
        self._lock = threading.Lock()

    def announce(self, engine: LLMEngine, spec: KVTransferSpec, prefill_id: str,
                 prefill_tp: int) -> None:
        """Engine thread, right after the reservation: the other ranks hold its pages and
        expect their routes (sent at once: the KV may arrive before any step)."""
        engine.tell_ranks(("expect", spec, prefill_id, prefill_tp), now=True)

    def expect(self, spec: KVTransferSpec, prefill_id: str, prefill_tp: int, import_layer
               ) -> None:
        """Post rank 0's routes (``import_layer(layer, kv, heads)`` writes each arriving
        layer), then wait until every other rank posted its own. Raises KVHandshakeError
        (the prefill's layout cannot map onto ours), or KVTransferError."""
        rid = spec.request_id
        routes = own_routes(self.layout.num_kv_heads, prefill_tp, self.engine.tp_size,
                             decode_rank=0)
        specs = [route_spec(spec, r) for r in routes]
        # What each rank will have received once the transfer is complete.
        per_rank = [0] * self.engine.tp_size
        for r in kv_routes(self.layout.num_kv_heads, prefill_tp, self.engine.tp_size):
            per_rank[r.decode_rank] += _route_bytes(spec, r)
        with self._lock:
            self._routes[rid] = _Transfer(spec, specs, per_rank)
        try:
            for r, rs in zip(routes, specs, strict=True):
                self.receiver.expect(rs, rank_peer_id(prefill_id, r.prefill_rank),
                                     lambda layer, kv, h=r.heads: import_layer(layer, kv, h))
            _await_ranks(self.engine, answer_key("exp", spec), time.monotonic() + _ANSWER_S,
                         f"receiving KV for {rid}")
        except BaseException:
            self.abort(rid)
            raise

    def wait(self, request_id: str, timeout_s: float) -> None:
        """Until every rank's routes arrived. Raises KVTransferTimeout / KVTransferError."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            tr = self._routes.get(request_id)
        if tr is None:
            raise KVTransferError(f"no KV transfer expected for {request_id!r} (aborted?)")
        try:
            for rs in tr.routes:
                self.receiver.wait(rs.request_id, max(deadline - time.monotonic(), 0.0))
            _await_ranks(self.engine, answer_key("done", tr.spec), deadline, f"KV for {request_id}")
            with self._lock:
                for rank, n in enumerate(tr.rank_bytes):
                    self.rank_bytes[rank] += n
        finally:
            with self._lock:
                if self._routes.get(request_id) is tr:
                    del self._routes[request_id]

    def abort(self, request_id: str) -> None:
        """Stop rank 0's receives (the other ranks stop theirs when the reservation is
        released on the engine: ``KVConnector.release``)."""
        with self._lock:
            tr = self._routes.pop(request_id, None)
        if tr is None:
            return
        for rs in tr.routes:
            self.receiver.abort(rs.request_id)
        self.engine.discard_rank_replies(answer_key("done", tr.spec))

    def live_pairs(self) -> dict[str, int]:
        return self.receiver.live_pairs()

    def close(self) -> None:
        self.receiver.close()


class PrefillRankKV:
    """Rank 0 of a prefill worker: its own sender, and the other ranks' through their agents."""

    def __init__(self, engine: LLMEngine, worker_id: str, layout: KVLayout, host: str,
                 transport: str, device: str | torch.device, timeout_s: float,
                 stream_layers: bool) -> None:
        self.engine = engine
        self.layout = layout
        self.sender = TorchDistSender(worker_id, layout, device=device, timeout_s=timeout_s,
                                      host=host, tp_size=engine.tp_size, tp_rank=0)
        try:
            engine.attach_rank_agents(AGENT, _config("prefill", worker_id, layout, host,
                                                     transport, timeout_s, stream_layers))
        except BaseException:
            self.sender.close()
            raise
        self._routes: dict[str, _Transfer] = {}  # request id -> rank 0's routes
        self.rank_bytes = [0] * engine.tp_size  # sent per rank (transfers delivered)
        self._lock = threading.Lock()

    def announce(self, engine: LLMEngine, spec: KVTransferSpec,
                 destinations: list[PeerAddress]) -> None:
        """Engine thread, with the request: every rank learns where its routes go (before
        the step that exports the prompt)."""
        routes = own_routes(self.layout.num_kv_heads, engine.tp_size, len(destinations),
                             prefill_rank=0)
        per_rank = [0] * engine.tp_size
        for r in kv_routes(self.layout.num_kv_heads, engine.tp_size, len(destinations)):
            per_rank[r.prefill_rank] += _route_bytes(spec, r)
        with self._lock:
            self._routes[spec.request_id] = _Transfer(
                spec, [route_spec(spec, r) for r in routes], per_rank,
                [(r, destinations[r.decode_rank]) for r in routes])
        engine.tell_ranks(("send", spec, list(destinations)))

    def send_layer(self, request_id: str, layer: int, kv: torch.Tensor,
                   heads: tuple[int, int]) -> None:
        """Rank 0's routes of one exported layer (its own heads ``heads``)."""
        with self._lock:
            tr = self._routes.get(request_id)
        for (route, dest), rs in zip(tr.targets, tr.routes, strict=True) if tr else ():
            self.sender.send_layer(dest, rs, layer, route_piece(kv, heads, route))

    def finish(self, request_id: str, timeout_s: float) -> None:
        """Until every rank's routes were delivered. Raises KVTransferError (and subclasses)
        or KVHandshakeError."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            tr = self._routes.get(request_id)
        if tr is None:
            raise KVTransferError(f"no KV transfer for {request_id!r} (aborted?)")
        for rs in tr.routes:
            self.sender.finish(rs, max(deadline - time.monotonic(), 0.0))
        _await_ranks(self.engine, answer_key("sent", tr.spec), deadline,
                     f"sending KV for {request_id}")
        with self._lock:
            if self._routes.get(request_id) is tr:
                del self._routes[request_id]
            for rank, n in enumerate(tr.rank_bytes):
                self.rank_bytes[rank] += n

    def abort(self, request_id: str) -> None:
        """Drop rank 0's unsent layers (the other ranks: ``abort_ranks``)."""
        with self._lock:
            tr = self._routes.pop(request_id, None)
        if tr is None:
            return
        for rs in tr.routes:
            self.sender.abort(rs)
        self.engine.discard_rank_replies(answer_key("sent", tr.spec))

    def abort_ranks(self, engine: LLMEngine, request_id: str) -> None:
        """Engine thread: the other ranks drop the request's routes."""
        engine.tell_ranks(("abort", request_id), now=True)

    def live_pairs(self) -> dict[str, int]:
        return self.sender.live_pairs()

    def close(self) -> None:
        self.sender.close()
