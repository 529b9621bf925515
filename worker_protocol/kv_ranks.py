"""A worker's KV endpoints on every tensor-parallel rank: KV over per-(prefill rank, decode
rank) pairs.

Each rank of a worker owns one endpoint: rank 0 (the worker's process) its own, every other
rank one in its agent (``RankKVAgent``, started through ``engine.parallel.agents``). A
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
import logging
import threading
import time
from dataclasses import dataclass

import torch

from engine.llm_engine import LLMEngine
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

__all__ = ["AGENT", "DecodeRankKV", "PrefillRankKV", "RankKVAgent"]

log = logging.getLogger(__name__)

AGENT = "worker_protocol.kv_ranks:RankKVAgent"
_ANSWER_S = 30.0  # a follower answers an announcement within this (it only posts receives)
_FOREVER_S = 7 * 24 * 3600.0  # a follower's wait ends with its transfer or its reservation


@dataclass(frozen=True)
class RankKVConfig:
    """What every rank's endpoint is built with (sent to the agents as a dict)."""

    role: str  # "prefill" | "decode"
    worker_id: str
    layout: dict  # KVLayout's fields
    host: str  # the worker's KV address (every rank binds it: they share a host)
    transport: str  # "nccl" | "gloo"
    timeout_s: float
    stream_layers: bool = True


def _error(e: BaseException) -> str:
    kind = "handshake" if isinstance(e, KVHandshakeError) else "transfer"
    return f"err:{kind}:{e}"


def _raise_answers(answers: list[str], what: str) -> None:
    """Re-raise the first follower error among ``answers`` as the KV error it was."""
    for rank, a in enumerate(answers, start=1):
        if a.startswith("err:"):
            _, kind, msg = a.split(":", 2)
            cls = KVHandshakeError if kind == "handshake" else KVTransferError
            raise cls(f"{what} on tensor-parallel rank {rank}: {msg}")


def _own_routes(num_kv_heads: int, prefill_tp: int, decode_tp: int, *, prefill_rank=None,
                decode_rank=None) -> list[KVRoute]:
    return [r for r in kv_routes(num_kv_heads, prefill_tp, decode_tp)
            if (prefill_rank is None or r.prefill_rank == prefill_rank)
            and (decode_rank is None or r.decode_rank == decode_rank)]


def _key(kind: str, spec: KVTransferSpec) -> str:
    """A follower answer's key: the transfer id too, so an answer left over from an earlier
    attempt at the same request (never read: rank 0 had failed it) cannot answer a new one."""
    return f"{kind}/{spec.request_id}#{spec.transfer_id}"


def _route_bytes(spec: KVTransferSpec, route: KVRoute) -> int:
    """What one route of ``spec`` moves: every layer of its heads."""
    layout = spec.layout
    return (2 * spec.num_tokens * route.num_heads * layout.head_dim
            * layout.torch_dtype.itemsize * layout.num_layers)


def _piece(kv: torch.Tensor, held: tuple[int, int], route: KVRoute) -> torch.Tensor:
    """The route's heads out of a rank's own ``[2, T, held heads, D]``."""
    lo, hi = route.heads[0] - held[0], route.heads[1] - held[0]
    return kv if (lo, hi) == (0, kv.shape[2]) else kv[:, :, lo:hi].contiguous()


# ---- the other ranks ----------------------------------------------------------------------
@dataclass
class _Sending:
    """A follower's part of one outgoing transfer: its routes and their destinations."""

    spec: KVTransferSpec
    routes: list[tuple[KVRoute, KVTransferSpec, PeerAddress]]
    num_layers: int
    held: list[tuple[int, torch.Tensor, tuple[int, int]]] = dataclasses.field(default_factory=list)
    error: str = ""


class RankKVAgent:
    """A follower rank's endpoint (``engine.parallel.agents.RankAgent``)."""

    def __init__(self, ctx, config: dict) -> None:
        self.ctx = ctx
        self.cfg = RankKVConfig(**config)
        self.layout = KVLayout(**self.cfg.layout)
        device = ctx.device if self.cfg.transport == "nccl" else "cpu"
        me = rank_peer_id(self.cfg.worker_id, ctx.rank)
        self._lock = threading.Lock()
        self._expected: dict[str, list[KVTransferSpec]] = {}  # decode: rid -> route specs
        self._sending: dict[str, _Sending] = {}  # prefill: rid -> routes
        self.receiver = self.sender = None
        if self.cfg.role == "decode":
            self.receiver = TorchDistReceiver(me, self.layout, host=self.cfg.host, device=device,
                                              timeout_s=self.cfg.timeout_s, tp_size=ctx.size,
                                              tp_rank=ctx.rank)
        else:
            self.sender = TorchDistSender(me, self.layout, device=device,
                                          timeout_s=self.cfg.timeout_s, host=self.cfg.host,
                                          tp_size=ctx.size, tp_rank=ctx.rank)

    def ready(self) -> str:
        if self.receiver is None:
            return ""
        return json.dumps(dataclasses.asdict(self.receiver.address))

    def on_tell(self, payload: tuple) -> None:
        kind = payload[0]
        if kind == "expect":
            self._expect(*payload[1:])
        elif kind == "send":
            self._plan_send(*payload[1:])
        elif kind == "abort":
            self._abort_send(payload[1])
        elif kind == "state":
            with self._lock:
                state = {"held_pages": self.ctx.num_held_pages(), "expected": len(self._expected),
                         "sending": len(self._sending)}
            self.ctx.reply("state", json.dumps(state))
        else:
            raise RuntimeError(f"unknown KV rank message {kind!r}")

    # ---- decode ranks ----------------------------------------------------------------------
    def _expect(self, spec: KVTransferSpec, prefill_id: str, prefill_tp: int) -> None:
        rid = spec.request_id
        routes = _own_routes(self.layout.num_kv_heads, prefill_tp, self.ctx.size,
                             decode_rank=self.ctx.rank)
        specs: list[KVTransferSpec] = []
        try:
            for r in routes:
                rs = route_spec(spec, r)
                self.receiver.expect(rs, rank_peer_id(prefill_id, r.prefill_rank),
                                     lambda layer, kv, h=r.heads: self.ctx.import_kv(
                                         rid, layer, kv, h))
                specs.append(rs)
        except Exception as e:
            for rs in specs:
                self.receiver.abort(rs.request_id)
            self.ctx.reply(_key("exp", spec), _error(e))
            return
        with self._lock:
            self._expected[rid] = specs
        self.ctx.reply(_key("exp", spec), "ok")
        threading.Thread(target=self._await, args=(spec, specs), daemon=True,
                         name=f"kv-rank{self.ctx.rank}-wait").start()

    def _await(self, spec: KVTransferSpec, specs: list[KVTransferSpec]) -> None:
        """Answer ``done`` once this rank's routes arrived or failed; nothing when the
        reservation ended first (rank 0 no longer waits)."""
        answer = "ok"
        try:
            for rs in specs:
                self.receiver.wait(rs.request_id, _FOREVER_S)
        except Exception as e:
            answer = _error(e)
        with self._lock:
            # Only this reservation's entry: a newer one for the same request id is not ours.
            live = self._expected.get(spec.request_id) is specs
            if live:
                del self._expected[spec.request_id]
        if live:
            self.ctx.reply(_key("done", spec), answer)

    def on_unreserve(self, request_id: str) -> None:
        with self._lock:
            specs = self._expected.pop(request_id, None)
        for rs in specs or ():
            self.receiver.abort(rs.request_id)  # wakes _await, which then stays silent

    # ---- prefill ranks ---------------------------------------------------------------------
    def _plan_send(self, spec: KVTransferSpec, destinations: list[PeerAddress]) -> None:
        routes = _own_routes(self.layout.num_kv_heads, self.ctx.size, len(destinations),
                             prefill_rank=self.ctx.rank)
        plan = _Sending(spec, [(r, route_spec(spec, r), destinations[r.decode_rank])
                               for r in routes], self.layout.num_layers)
        with self._lock:
            self._sending[spec.request_id] = plan

    def on_export(self, request_id: str, layer: int, kv: torch.Tensor,
                  heads: tuple[int, int]) -> None:
        with self._lock:
            plan = self._sending.get(request_id)
        if plan is None:
            return  # aborted, or no route leaves this rank
        if self.cfg.stream_layers:
            self._send(plan, layer, kv, heads)
        else:
            plan.held.append((layer, kv, heads))
        if layer == plan.num_layers - 1:
            for held in plan.held:
                self._send(plan, *held)
            plan.held.clear()
            with self._lock:
                self._sending.pop(request_id, None)
            threading.Thread(target=self._finish, args=(plan,), daemon=True,
                             name=f"kv-rank{self.ctx.rank}-finish").start()

    def _send(self, plan: _Sending, layer: int, kv: torch.Tensor,
              heads: tuple[int, int]) -> None:
        if plan.error:
            return
        try:
            for route, rs, dest in plan.routes:
                self.sender.send_layer(dest, rs, layer, _piece(kv, heads, route))
        except Exception as e:  # a refusal or a closed sender: rank 0 hears it at finish
            plan.error = _error(e)
            for _, rs, _ in plan.routes:
                self.sender.abort(rs)

    def _finish(self, plan: _Sending) -> None:
        answer = plan.error or "ok"
        if not plan.error:
            try:
                for _, rs, _ in plan.routes:
                    self.sender.finish(rs, self.cfg.timeout_s)
            except Exception as e:
                answer = _error(e)
                for _, rs, _ in plan.routes:
                    self.sender.abort(rs)
        self.ctx.reply(_key("sent", plan.spec), answer)

    def _abort_send(self, rid: str) -> None:
        with self._lock:
            plan = self._sending.pop(rid, None)
        for _, rs, _ in plan.routes if plan is not None else ():
            self.sender.abort(rs)

    def close(self) -> None:
        for endpoint in (self.sender, self.receiver):
            if endpoint is not None:
                endpoint.close()


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
        routes = _own_routes(self.layout.num_kv_heads, prefill_tp, self.engine.tp_size,
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
            if self.engine.tp_size > 1:
                try:
                    answers = self.engine.rank_replies(_key("exp", spec), _ANSWER_S)
                except (TimeoutError, RuntimeError) as e:
                    raise KVTransferError(f"cannot receive KV for {rid}: {e}") from None
                _raise_answers(answers, f"receiving KV for {rid}")
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
            if self.engine.tp_size > 1:
                try:
                    answers = self.engine.rank_replies(
                        _key("done", tr.spec), max(deadline - time.monotonic(), 0.0))
                except TimeoutError as e:
                    raise KVTransferTimeout(f"KV for {request_id!r}: {e}") from None
                except RuntimeError as e:
                    raise KVTransferError(f"KV for {request_id!r}: {e}") from None
                _raise_answers(answers, f"KV for {request_id}")
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
        self.engine.discard_rank_replies(_key("done", tr.spec))

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
        routes = _own_routes(self.layout.num_kv_heads, engine.tp_size, len(destinations),
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
            self.sender.send_layer(dest, rs, layer, _piece(kv, heads, route))

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
        if self.engine.tp_size > 1:
            try:
                answers = self.engine.rank_replies(_key("sent", tr.spec),
                                                   max(deadline - time.monotonic(), 0.0))
            except TimeoutError as e:
                raise KVTransferTimeout(f"KV send for {request_id!r}: {e}") from None
            except RuntimeError as e:
                raise KVTransferError(f"KV send for {request_id!r}: {e}") from None
            _raise_answers(answers, f"sending KV for {request_id}")
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
        self.engine.discard_rank_replies(_key("sent", tr.spec))

    def abort_ranks(self, engine: LLMEngine, request_id: str) -> None:
        """Engine thread: the other ranks drop the request's routes."""
        engine.tell_ranks(("abort", request_id), now=True)

    def live_pairs(self) -> dict[str, int]:
        return self.sender.live_pairs()

    def close(self) -> None:
        self.sender.close()
