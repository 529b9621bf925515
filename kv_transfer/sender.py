"""Prefill side of the KV transport: one ordered outbox per decode peer.

``send_layer`` queues a layer and returns at once; one thread per peer posts the queued
messages (``kv_transfer.wire``: header, then payload) in the order they were queued, waits for
each, and counts them against their transfer. One thread per peer is what makes the channel
NCCL-safe: the receiver reads headers in exactly this order, whatever the interleaving of
requests within a batched prefill step.

Tensors on a GPU: over NCCL (``device="cuda"``) they are sent from a side stream after an
event recorded when they were queued (so the compute stream is never blocked); over gloo
(``device="cpu"``, e.g. prefill and decode sharing one GPU, where NCCL cannot pair two ranks)
they are copied into pinned host memory on the compute stream and sent once that copy is done.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kv_transfer.endpoints import LOCAL, probe, unreachable
from kv_transfer.pairs import FOREVER, Pair, PairOwner, build_group, gen_key, store_key
from kv_transfer.protocol import (
    KVHandshakeError,
    KVLayout,
    KVPeerUnreachableError,
    KVTransferAborted,
    KVTransferError,
    KVTransferSpec,
    KVTransferTimeout,
    check_layer_tensor,
)
from kv_transfer.routes import KVPlace
from kv_transfer.transport import KVSender, PeerAddress, TransferState
from kv_transfer.wire import ABORT_LAYER, DATA_TAG, Header

_POLL_S = 0.005


class _SendTransfer(TransferState):
    def __init__(self, spec: KVTransferSpec, peer: PeerAddress) -> None:
        super().__init__(spec)
        self.peer = peer
        self.num_sent = 0  # layers queued by send_layer
        self.num_posted = 0  # layers the outbox began to post
        # The generation whose channel carries its layers: a transfer never spans two.
        self.pair_gen: int | None = None


@dataclass
class _Message:
    """One queued layer (or, with ``ABORT_LAYER``, the notice that its transfer is dropped)."""

    tr: _SendTransfer
    layer: int
    kv: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None  # recorded after the kernel writing kv (GPU only)


@dataclass
class _Outbox:
    """The messages queued for one decode peer, and the thread posting them in order."""

    peer_id: str
    queue: deque[_Message] = field(default_factory=deque)
    cond: threading.Condition = field(default_factory=threading.Condition)
    thread: threading.Thread | None = None


class TorchDistSender(PairOwner, KVSender):
    """Prefill side: connects to decode workers' stores and streams layers to them."""

    def __init__(self, worker_id: str, layout: KVLayout, device: str | torch.device = "cpu",
                 timeout_s: float = 30.0, host: str = LOCAL, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
        """``host``: this worker's own KV address (gloo binds it; peers connect back to it).
        ``device``: "cpu" sends over gloo (GPU tensors are staged through pinned host memory),
        "cuda" over NCCL; both ends of a pair must choose the same. ``tp_size`` /
        ``tp_rank``: which rank of its worker this endpoint serves (the handshake says so;
        each pair then carries the heads the two ranks share: ``kv_transfer.routes``)."""
        self.place = KVPlace(layout, tp_size, tp_rank)
        self._host = host
        self._stores: dict[str, dist.Store] = {}  # decode worker id -> control client
        # decode worker id -> the (host, port) its cached store client and pair belong to
        self._addresses: dict[str, tuple[str, int]] = {}
        self._store_lock = threading.Lock()
        self._transfers: dict[str, _SendTransfer] = {}
        self._outboxes: dict[str, _Outbox] = {}
        self._refusals: dict[str, KVHandshakeError] = {}
        self._send_stream = None
        super().__init__(worker_id, layout, device, timeout_s)

    # ---- the KVSender interface ---------------------------------------------------------------
    def send_layer(self, peer: PeerAddress, spec: KVTransferSpec, layer: int,
                   kv: torch.Tensor) -> None:
        check_layer_tensor(spec, layer, kv)
        refusal = self._refusals.get(peer.worker_id)
        if refusal is not None and self._addresses.get(peer.worker_id) == (peer.host, peer.port):
            raise refusal
        kv, ready = self._stage(kv)
        with self._lock:
            if self._closed.is_set():
                raise KVTransferError("sender is closed")
            tr = self._transfers.get(spec.request_id)
            if tr is None:
                tr = self._transfers[spec.request_id] = _SendTransfer(spec, peer)
            tr.num_sent += 1
        self._enqueue(_Message(tr, layer, kv, ready))

    def finish(self, spec: KVTransferSpec, timeout_s: float) -> None:
        with self._lock:
            tr = self._transfers.get(spec.request_id)
        if tr is None:
            raise ValueError(f"finish: nothing was sent for request {spec.request_id!r}")
        if tr.num_sent != spec.layout.num_layers:
            self.abort(spec)
            raise ValueError(f"finish: {tr.num_sent} of {spec.layout.num_layers} layers were sent")
        finished = tr.done.wait(timeout_s)
        with self._lock:
            self._transfers.pop(spec.request_id, None)
        if not finished:
            tr.fail(KVTransferTimeout(f"KV send for request {spec.request_id!r} not received "
                                      f"after {timeout_s}s"))
            self._discard_gen(tr.peer.worker_id, tr.pair_gen)  # a stuck channel
        tr.raise_if_failed()

    def abort(self, spec: KVTransferSpec) -> None:
        with self._lock:
            tr = self._transfers.pop(spec.request_id, None)
        if tr is not None:
            tr.aborted = True
            tr.fail(KVTransferAborted(f"send for request {spec.request_id!r} was aborted"))
            # In order behind its queued layers (which the outbox now skips): the receiver
            # fails the transfer at once instead of at its lease's end.
            self._enqueue(_Message(tr, ABORT_LAYER))

    def close(self) -> None:
        if self._closed.is_set():
            return
        with self._lock:
            transfers = list(self._transfers.values())
            self._transfers.clear()
            outboxes = list(self._outboxes.values())
        for tr in transfers:
            tr.fail(KVTransferError("sender closed"))
        self._close_pairs()  # sets _closed; wakes every blocked send
        for box in outboxes:
            with box.cond:
                box.cond.notify_all()
        for box in outboxes:
            if box.thread is not None:
                box.thread.join(timeout=self.timeout_s)
        with self._store_lock:
            self._stores.clear()

    # ---- queueing --------------------------------------------------------------------------
    def _stage(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The tensor the outbox will send and the event it must wait for first."""
        if not kv.is_cuda:
            return (kv.to(self.device), None) if self.device.type == "cuda" else (kv, None)
        if self.device.type == "cpu":  # gloo: through pinned host memory
            host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
            host.copy_(kv, non_blocking=True)
            kv = host
        ready = torch.cuda.Event()
        ready.record()
        return kv, ready

    def _enqueue(self, msg: _Message) -> None:
        peer_id = msg.tr.peer.worker_id
        with self._lock:
            box = self._outboxes.get(peer_id)
            if box is None:
                box = self._outboxes[peer_id] = _Outbox(peer_id)
                box.thread = threading.Thread(target=self._drain, args=(box,), daemon=True,
                                              name=f"kv-send-{peer_id}")
                box.thread.start()
        with box.cond:
            box.queue.append(msg)
            box.cond.notify()

    def _drain(self, box: _Outbox) -> None:
        """The peer's outbox thread: post its messages one at a time, in queue order."""
        while True:
            with box.cond:
                while not box.queue and not self._closed.is_set():
                    box.cond.wait()
                if self._closed.is_set():
                    return
                msg = box.queue.popleft()
            self._send(msg)

    # ---- posting ------------------------------------------------------------------------------
    def _send(self, msg: _Message) -> None:
        tr = msg.tr
        if msg.layer == ABORT_LAYER:
            self._send_abort(tr)
            return
        if tr.done.is_set():
            return  # aborted or failed: its remaining layers are dropped
        pair = None
        try:
            pair = self._pair_for(tr.peer) if tr.pair_gen is None else self._pair_of(tr)
            tr.pair_gen = pair.gen
            tr.num_posted += 1
            header = Header(tr.spec.transfer_id, msg.layer, tr.spec.num_tokens)
            self._post(pair, header, msg.kv, msg.ready)
            tr.num_layers_done += 1
            if tr.num_layers_done == tr.spec.layout.num_layers:
                tr.complete()
        except (KVTransferError, KVHandshakeError) as e:
            tr.fail(e)
        except RuntimeError as e:  # the peer died, or the pair was torn down
            if pair is not None:
                self._discard(pair, self._stores.get(pair.peer_id))
                self._fail_on_gen(pair.peer_id, pair.gen, KVTransferError(
                    f"KV send to {pair.peer_id!r} failed: {str(e).splitlines()[0]}"))
            tr.fail(KVTransferError(f"KV send to {tr.peer.worker_id!r} failed: {e}"))

    def _pair_of(self, tr: _SendTransfer) -> Pair:
        """The pair a started transfer's layers go on (checked once per transfer, not per
        layer: a store round trip per layer would cost more than a small layer's send)."""
        with self._lock:
            pair = self._pairs.get(tr.peer.worker_id)
        if pair is None or pair.dead or pair.gen != tr.pair_gen:
            raise KVTransferError(f"KV pair with {tr.peer.worker_id!r} was torn down "
                                  f"mid-transfer (generation {tr.pair_gen})")
        return pair

    def _send_abort(self, tr: _SendTransfer) -> None:
        """Tell the receiver the transfer will not complete: it expects every transfer whose
        spec it issued, and would otherwise hold the pages until its lease runs out."""
        pair = None
        try:
            pair = self._pair_for(tr.peer) if tr.pair_gen is None else self._pair_of(tr)
            self._post(pair, Header(tr.spec.transfer_id, ABORT_LAYER, 0), None, None)
        except (KVTransferError, KVHandshakeError):
            pass  # no pair, or its pair is gone: the receiver failed it with the pair
        except RuntimeError:
            if pair is not None:
                self._discard(pair, self._stores.get(pair.peer_id))

    def _post(self, pair: Pair, header: Header, kv: torch.Tensor | None,
              ready: torch.cuda.Event | None) -> None:
        """Send the header and its payload back to back and wait for both."""
        if self.device.type == "cuda":
            if self._send_stream is None:
                self._send_stream = torch.cuda.Stream(device=self.device)
            if ready is not None:
                self._send_stream.wait_event(ready)
            with torch.cuda.stream(self._send_stream):
                works = [pair.pg.send([header.encode(self.device)], pair.peer_rank, DATA_TAG)]
                if kv is not None:
                    kv.record_stream(self._send_stream)  # allocated on the compute stream
                    works.append(pair.pg.send([kv], pair.peer_rank, DATA_TAG))
        else:
            if ready is not None:
                ready.synchronize()  # the copy into pinned host memory is done
            works = [pair.pg.send([header.encode()], pair.peer_rank, DATA_TAG)]
            if kv is not None:
                works.append(pair.pg.send([kv], pair.peer_rank, DATA_TAG))
        for work in works:
            work.wait(FOREVER)

    def _fail_on_gen(self, peer_id: str, gen: int, error: KVTransferError) -> None:
        with self._lock:
            hit = [t for t in self._transfers.values()
                   if t.peer.worker_id == peer_id and t.pair_gen == gen and not t.done.is_set()]
        for tr in hit:
            tr.fail(error)

    # ---- pairs --------------------------------------------------------------------------------
    def _control_store(self, pair: Pair) -> dist.Store | None:
        return self._stores.get(pair.peer_id)

    def _sget(self, peer: PeerAddress, fn, *args):
        """One call on the peer's store. Callers hold the peer's lock (``_pair_for``), so the
        connect below never blocks transfers to other peers. Raises KVPeerUnreachableError
        naming the address when the store cannot be reached (the cached client is dropped,
        so a recovered peer is reconnected)."""
        with self._store_lock:
            store = self._stores.get(peer.worker_id)
        try:
            if store is None:
                # Half the transfer's deadline (at least 1 s): an address nobody answers at
                # fails the transfer naming it, never as a bare timeout of the whole send.
                probe(peer, max(1.0, self.timeout_s / 2))
                store = dist.TCPStore(peer.host, peer.port, None, False,
                                      datetime.timedelta(seconds=self.timeout_s))
                with self._store_lock:
                    self._stores[peer.worker_id] = store
            return getattr(store, fn)(*args)
        except KVPeerUnreachableError:
            raise
        except RuntimeError as e:  # c10d's DistNetworkError / store timeouts
            with self._store_lock:
                self._stores.pop(peer.worker_id, None)
            raise unreachable(peer, self.timeout_s, str(e).splitlines()[0]) from None

    def _forget_if_moved(self, peer: PeerAddress) -> None:
        """A decode worker that Ray restarted keeps its id but listens on a new port: drop the
        cached store client, refusal and group of its old process, so it is joined afresh
        (its new store numbers generations from the start again). Caller holds the peer lock."""
        where = (peer.host, peer.port)
        with self._store_lock:
            known = self._addresses.get(peer.worker_id)
            if known == where:
                return
            self._addresses[peer.worker_id] = where
            self._stores.pop(peer.worker_id, None)
        self._refusals.pop(peer.worker_id, None)
        with self._lock:
            pair = self._pairs.get(peer.worker_id)
        if pair is not None:
            self._discard(pair, None)  # its store went with the old process

    def _pair_for(self, peer: PeerAddress) -> Pair:
        """The live group with peer, proposing a new generation (and handshaking) if needed."""
        with self._peer_lock(peer.worker_id):
            self._forget_if_moved(peer)
            with self._lock:
                pair = self._pairs.get(peer.worker_id)
            me = self.worker_id
            if pair is not None and not pair.dead:
                if not self._sget(peer, "check", [store_key(me, pair.gen, "retired")]):
                    return pair
                self._discard(pair, None)
            deadline = time.monotonic() + self.timeout_s
            gen = self._sget(peer, "add", gen_key(me), 1)
            self._sget(peer, "set", store_key(me, gen, "layout"), self.place.to_json())
            verdict_key = store_key(me, gen, "verdict")
            while not self._sget(peer, "check", [verdict_key]):
                if time.monotonic() > deadline or self._closed.is_set():
                    raise KVTransferTimeout(f"decode worker {peer.worker_id!r} did not answer "
                                            f"the KV handshake within {self.timeout_s}s")
                time.sleep(_POLL_S)
            verdict = self._sget(peer, "get", verdict_key).decode()
            if verdict != "ok":
                err = KVHandshakeError(verdict.removeprefix("refused:"))
                self._refusals[peer.worker_id] = err
                raise err
            try:
                client = dist.TCPStore(peer.host, peer.port, None, False,
                                       datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as e:
                raise unreachable(peer, self.timeout_s, str(e).splitlines()[0]) from None
            try:
                pg = build_group(client, me, peer.worker_id, gen, 1, self.device, self._host,
                                 max(deadline - time.monotonic(), 0.1))
            except RuntimeError as e:
                raise KVTransferTimeout(f"group with {peer.worker_id!r} (gen {gen}) failed: {e}") from e
            pair = Pair(peer.worker_id, gen, pg, peer_rank=0, store=client)
            with self._lock:
                self._pairs[peer.worker_id] = pair
            return pair
