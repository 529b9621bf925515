"""The KV endpoint of a tensor-parallel worker's other ranks (rank > 0): ``RankKVAgent``,
built in each follower process by ``engine.parallel.agents`` from the worker's
``RankKVConfig``; rank 0's side and the protocol between them: ``worker_protocol.kv_ranks``.

A decode rank posts its routes' receives when rank 0 announces a reservation and answers
``exp`` at once, then ``done`` when they arrived; a prefill rank sends its routes as the step
exports its heads and answers ``sent``. Answers go through the group's store
(``FollowerContext.reply``), keyed by ``answer_key``.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass

import torch

from kv_transfer import (
    KVHandshakeError,
    KVLayout,
    KVTransferSpec,
    PeerAddress,
    TorchDistReceiver,
    TorchDistSender,
)
from kv_transfer.routes import KVRoute, kv_routes, rank_peer_id, route_spec

__all__ = ["RankKVAgent", "RankKVConfig", "answer_key", "error_answer", "own_routes",
           "route_piece"]

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


def error_answer(e: BaseException) -> str:
    """A follower's answer for a failure: the kind of KV error and its message."""
    kind = "handshake" if isinstance(e, KVHandshakeError) else "transfer"
    return f"err:{kind}:{e}"


def own_routes(num_kv_heads: int, prefill_tp: int, decode_tp: int, *,
               prefill_rank: int | None = None, decode_rank: int | None = None) -> list[KVRoute]:
    """The routes that leave ``prefill_rank`` or reach ``decode_rank`` (kv_transfer.routes)."""
    return [r for r in kv_routes(num_kv_heads, prefill_tp, decode_tp)
            if (prefill_rank is None or r.prefill_rank == prefill_rank)
            and (decode_rank is None or r.decode_rank == decode_rank)]


def answer_key(kind: str, spec: KVTransferSpec) -> str:
    """A follower answer's key: the transfer id too, so an answer left over from an earlier
    attempt at the same request (never read: rank 0 had failed it) cannot answer a new one."""
    return f"{kind}/{spec.request_id}#{spec.transfer_id}"


def route_piece(kv: torch.Tensor, held: tuple[int, int], route: KVRoute) -> torch.Tensor:
    """The route's heads out of a rank's own ``[2, T, held heads, D]``."""
    lo, hi = route.heads[0] - held[0], route.heads[1] - held[0]
    return kv if (lo, hi) == (0, kv.shape[2]) else kv[:, :, lo:hi].contiguous()


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
        routes = own_routes(self.layout.num_kv_heads, prefill_tp, self.ctx.size,
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
            self.ctx.reply(answer_key("exp", spec), error_answer(e))
            return
        with self._lock:
            self._expected[rid] = specs
        self.ctx.reply(answer_key("exp", spec), "ok")
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
            answer = error_answer(e)
        with self._lock:
            # Only this reservation's entry: a newer one for the same request id is not ours.
            live = self._expected.get(spec.request_id) is specs
            if live:
                del self._expected[spec.request_id]
        if live:
            self.ctx.reply(answer_key("done", spec), answer)

    def on_unreserve(self, request_id: str) -> None:
        with self._lock:
            specs = self._expected.pop(request_id, None)
        for rs in specs or ():
            self.receiver.abort(rs.request_id)  # wakes _await, which then stays silent

    # ---- prefill ranks ---------------------------------------------------------------------
    def _plan_send(self, spec: KVTransferSpec, destinations: list[PeerAddress]) -> None:
        routes = own_routes(self.layout.num_kv_heads, self.ctx.size, len(destinations),
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
                self.sender.send_layer(dest, rs, layer, route_piece(kv, heads, route))
        except Exception as e:  # a refusal or a closed sender: rank 0 hears it at finish
            plan.error = error_answer(e)
            for _, rs, _ in plan.routes:
                self.sender.abort(rs)

    def _finish(self, plan: _Sending) -> None:
        answer = plan.error or "ok"
        if not plan.error:
            try:
                for _, rs, _ in plan.routes:
                    self.sender.finish(rs, self.cfg.timeout_s)
            except Exception as e:
                answer = error_answer(e)
                for _, rs, _ in plan.routes:
                    self.sender.abort(rs)
        self.ctx.reply(answer_key("sent", plan.spec), answer)

    def _abort_send(self, rid: str) -> None:
        with self._lock:
            plan = self._sending.pop(rid, None)
        for _, rs, _ in plan.routes if plan is not None else ():
            self.sender.abort(rs)

    def close(self) -> None:
        for endpoint in (self.sender, self.receiver):
            if endpoint is not None:
                endpoint.close()
