"""Decode side of the KV transport: hosts the TCPStore, receives every prefill peer's channel.

One reader thread per prefill peer reads that pair's channel in order (``kv_transfer.wire``):
a header, then the payload it announces, and hands the layer to the transfer it names. So no
receive is ever posted for a particular transfer: an aborted transfer leaves nothing posted
behind (its late layers are read and dropped), and NCCL's in-order matching is all the
channel needs. ``expect`` must happen before the sender's first layer: the transfer spec
comes from this side (``DecodeWorker.reserve``), so it always does in the cluster; a layer
for a transfer nobody expects is read and dropped (``dropped_messages``).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kv_transfer.endpoints import LOCAL, listening_store
from kv_transfer.pairs import FOREVER, Pair, PairOwner, build_group, gen_key, store_key
from kv_transfer.protocol import (
    KVHandshakeError,
    KVLayout,
    KVTransferAborted,
    KVTransferError,
    KVTransferSpec,
    KVTransferTimeout,
)
from kv_transfer.routes import KVPlace, pair_heads
from kv_transfer.transport import KVReceiver, OnLayer, PeerAddress, TransferState
from kv_transfer.wire import ABORT_LAYER, DATA_TAG, Header, KVProtocolError, empty_header

_OWN_STORE_TIMEOUT_S = 60.0
_POLL_S = 0.005
_RECENT_ABORTS = 4096


class _RecvTransfer(TransferState):
    def __init__(self, spec: KVTransferSpec, peer_id: str, on_layer: OnLayer) -> None:
        super().__init__(spec)
        self.peer_id = peer_id
        self.on_layer = on_layer
        # The generation whose channel carried its first layer: it fails with that pair.
        self.pair_gen: int | None = None
        # When the last layer landed (None until the first): a started transfer that then
        # waits longer than the timeout for its next layer has stalled (a cut link).
        self.progress_at: float | None = None


@dataclass
class _Peer:
    """One prefill peer: its expected transfers by id, and the thread reading its channel."""

    peer_id: str
    transfers: dict[int, _RecvTransfer] = field(default_factory=dict)
    reader: threading.Thread | None = None

    def waiting(self) -> bool:
        return any(not t.done.is_set() for t in self.transfers.values())


class TorchDistReceiver(PairOwner, KVReceiver):
    """Decode side: hosts the TCPStore (``.address``) and receives from any prefill worker."""

    def __init__(self, worker_id: str, layout: KVLayout, host: str = LOCAL, port: int = 0,
                 device: str | torch.device = "cpu", timeout_s: float = 30.0,
                 tp_size: int = 1, tp_rank: int = 0) -> None:
        """``host``: the address other hosts reach this worker at; it is advertised (with the
        store's port) as ``.address``, gloo binds it, and the store listens on it alone (a
        TCPStore of its own would listen on every interface: anyone reaching any of them
        could write its keys). ``device``: "cpu" receives over gloo (layers arrive as CPU
        tensors, whatever device the caller's pages are on), "cuda" over NCCL. ``tp_size`` /
        ``tp_rank``: which rank of its worker this endpoint serves (it receives that rank's
        KV heads only, from the prefill ranks that hold them: ``kv_transfer.routes``)."""
        self.place = KVPlace(layout, tp_size, tp_rank)
        self._host = host
        # Our own connections to our own store: a generous timeout, since the transfer
        # timeout may be a few seconds and a busy host (workers loading models) can be slow
        # to accept even on loopback. Every wait on the store is bounded in Python anyway.
        self._own_timeout = datetime.timedelta(seconds=max(timeout_s, _OWN_STORE_TIMEOUT_S))
        # Our own store clients connect where the store listens (its KV address, or
        # loopback when that address is not this host's).
        self._store, self._own_host = listening_store(host, port, self._own_timeout)
        self._store_lock = threading.Lock()
        self.address = PeerAddress(worker_id, host, self._store.port)
        self._transfers: dict[str, _RecvTransfer] = {}
        self._peers: dict[str, _Peer] = {}
        self._aborted: deque[str] = deque(maxlen=_RECENT_ABORTS)
        self._last_gen: dict[str, int] = {}  # newest generation joined (or refused) per peer
        # (peer, generation) we closed because the sender proposed a newer one: transfers it
        # has not begun on the old one are still coming (on the new one).
        self._superseded: set[tuple[str, int]] = set()
        self.dropped_messages = 0  # layers of transfers nobody waits for (aborted, unknown)
        super().__init__(worker_id, layout, device, timeout_s)

    def _control_store(self, pair: Pair) -> dist.Store | None:
        return self._store

    def _sget(self, fn, *args):
        with self._store_lock:
            return getattr(self._store, fn)(*args)

    # ---- the KVReceiver interface -----------------------------------------------------------
    def expect(self, spec: KVTransferSpec, peer_id: str, on_layer: OnLayer) -> None:
        self.layout.check_compatible(spec.layout)
        lo, hi = spec.heads or (0, self.layout.num_kv_heads)
        mine = self.place.heads
        if not mine[0] <= lo < hi <= mine[1]:
            raise ValueError(f"transfer {spec.request_id!r} carries KV heads {lo}..{hi - 1}; "
                             f"this endpoint holds {mine[0]}..{mine[1] - 1}")
        tr = _RecvTransfer(spec, peer_id, on_layer)
        with self._lock:
            if self._closed.is_set():
                raise KVTransferError("receiver is closed")
            if spec.request_id in self._transfers:
                raise ValueError(f"transfer for request {spec.request_id!r} already expected")
            peer = self._peers.setdefault(peer_id, _Peer(peer_id))
            clash = peer.transfers.get(spec.transfer_id)
            if clash is not None:  # the headers could not tell the two apart
                raise ValueError(f"transfer id {spec.transfer_id} from {peer_id!r} is already "
                                 f"in flight (request {clash.spec.request_id!r})")
            self._transfers[spec.request_id] = tr
            peer.transfers[spec.transfer_id] = tr
            start = peer.reader is None
            if start:
                peer.reader = threading.Thread(target=self._read_peer, args=(peer,), daemon=True,
                                               name=f"kv-recv-{peer_id}")
        if start:
            peer.reader.start()
        else:
            self._drop_if_superseded(peer_id)

    def wait(self, request_id: str, timeout_s: float) -> None:
        with self._lock:
            tr = self._transfers.get(request_id)
            was_aborted = request_id in self._aborted
        if tr is None:
            if was_aborted:
                raise KVTransferAborted(f"transfer for request {request_id!r} was aborted")
            raise ValueError(f"no transfer expected for request {request_id!r}")
        finished = tr.done.wait(timeout_s)
        self._forget(tr)
        if not finished:
            tr.fail(KVTransferTimeout(f"KV for request {request_id!r} not complete after {timeout_s}s"))
            if tr.progress_at is not None:  # stuck mid-transfer: the channel is suspect
                self._discard_gen(tr.peer_id, tr.pair_gen)
        tr.raise_if_failed()

    def abort(self, request_id: str) -> None:
        with self._lock:
            tr = self._transfers.get(request_id)
            if tr is not None:
                self._aborted.append(request_id)
        if tr is not None:
            tr.aborted = True
            tr.fail(KVTransferAborted(f"transfer for request {request_id!r} was aborted"))
            self._forget(tr)

    def close(self) -> None:
        if self._closed.is_set():
            return
        with self._lock:
            transfers = list(self._transfers.values())
            readers = [p.reader for p in self._peers.values() if p.reader is not None]
        for tr in transfers:
            tr.fail(KVTransferError("receiver closed"))
        self._close_pairs()  # wakes every blocked read
        for t in readers:
            t.join(timeout=self.timeout_s)
        del self._store

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _forget(self, tr: _RecvTransfer) -> None:
        with self._lock:
            if self._transfers.get(tr.spec.request_id) is tr:
                del self._transfers[tr.spec.request_id]
            peer = self._peers.get(tr.peer_id)
            if peer is not None and peer.transfers.get(tr.spec.transfer_id) is tr:
                del peer.transfers[tr.spec.transfer_id]

    def _fail_started(self, peer_id: str, gen: int, error: KVTransferError) -> None:
        """Fail the transfers whose layers travelled on generation ``gen`` (the rest arrive
        on the sender's newer one)."""
        with self._lock:
            peer = self._peers.get(peer_id)
            started = [t for t in peer.transfers.values() if t.pair_gen == gen] if peer else []
        for tr in started:
            tr.fail(error)

    def _drop_if_superseded(self, peer_id: str) -> None:
        """The sender proposed a newer generation or retired ours (it gave up on the pair):
        close ours, so the reader stops waiting on it and joins the new one. Gloo notices a
        closed peer by itself; a half-open link or an aborted NCCL peer may not."""
        with self._lock:
            pair = self._pairs.get(peer_id)
        if pair is None or pair.dead:
            return
        if (self._sget("add", gen_key(peer_id), 0) != pair.gen
                or self._sget("check", [store_key(peer_id, pair.gen, "retired")])):
            with self._lock:
                self._superseded.add((peer_id, pair.gen))
            self._discard(pair, self._store)

    # ---- the reader thread, one per peer -----------------------------------------------------
    def _read_peer(self, peer: _Peer) -> None:
        """Join the peer's newest generation and read its channel; on a broken pair fail the
        transfers that were on it and join the next one, while anyone still waits."""
        try:
            while not self._closed.is_set():
                with self._lock:
                    if not peer.waiting():
                        return
                try:
                    pair = self._join(peer)
                except KVTransferError as e:  # never connected, closed
                    self._fail_waiting(peer, e)
                    return
                except KVHandshakeError as e:
                    self._fail_waiting(peer, e)
                    continue
                try:
                    self._read_channel(pair, peer)
                except KVProtocolError as e:
                    self._discard(pair, self._store)
                    self._fail_waiting(peer, e)
                except RuntimeError as e:  # the peer died, or the pair was torn down
                    self._discard(pair, self._store)
                    error = KVTransferError(
                        f"KV transfer from {peer.peer_id!r} failed: {str(e).splitlines()[0]}")
                    with self._lock:
                        superseded = (peer.peer_id, pair.gen) in self._superseded
                        self._superseded.discard((peer.peer_id, pair.gen))
                    if superseded:  # the sender moved on: what it has not begun comes on the new one
                        self._fail_started(peer.peer_id, pair.gen, error)
                    else:  # it died or gave up on the pair: nothing more comes from it
                        self._fail_waiting(peer, error)
        finally:
            with self._lock:
                peer.reader = None
                restart = peer.waiting() and not self._closed.is_set()
                if restart:  # an expect raced with our exit: keep reading for it
                    peer.reader = threading.Thread(target=self._read_peer, args=(peer,),
                                                   daemon=True, name=f"kv-recv-{peer.peer_id}")
            if restart:
                peer.reader.start()

    def _fail_waiting(self, peer: _Peer, error: BaseException) -> None:
        with self._lock:
            waiting = [t for t in peer.transfers.values() if not t.done.is_set()]
        for tr in waiting:
            tr.fail(error)

    def _join(self, peer: _Peer) -> Pair:
        """The live group with the peer, joining the sender's newest generation if needed;
        waits for the sender to propose one as long as a transfer from it is expected."""
        peer_id = peer.peer_id
        with self._peer_lock(peer_id):
            with self._lock:
                pair = self._pairs.get(peer_id)
            if pair is not None and not pair.dead:
                return pair
            last = self._last_gen.get(peer_id, 0)
            while (latest := self._sget("add", gen_key(peer_id), 0)) <= last:
                with self._lock:
                    waiting = peer.waiting()
                if self._closed.is_set() or not waiting:
                    raise KVTransferError(f"stopped waiting for prefill worker {peer_id!r}")
                time.sleep(_POLL_S)
            self._last_gen[peer_id] = latest
            deadline = time.monotonic() + self.timeout_s
            layout_key = store_key(peer_id, latest, "layout")
            while not self._sget("check", [layout_key]):
                if time.monotonic() > deadline:
                    raise KVTransferTimeout(f"prefill worker {peer_id!r} sent no layout")
                time.sleep(_POLL_S)
            try:
                theirs, claimed = KVPlace.from_json(self._sget("get", layout_key))
                heads = pair_heads(theirs, claimed, self.place, peer_id, self.worker_id)
            except (KVHandshakeError, ValueError, KeyError, TypeError) as e:
                if not isinstance(e, KVHandshakeError):
                    e = KVHandshakeError(f"KV handshake refused: {peer_id!r} sent an "
                                         f"unreadable place ({e})")
                self._sget("set", store_key(peer_id, latest, "verdict"), "refused:" + str(e))
                raise e from None
            self._sget("set", store_key(peer_id, latest, "verdict"), "ok")
            client = dist.TCPStore(self._own_host, self.address.port, None, False,
                                   self._own_timeout)
            try:
                pg = build_group(client, peer_id, self.worker_id, latest, 0, self.device,
                                 self._host, max(deadline - time.monotonic(), 0.1))
            except RuntimeError as e:
                raise KVTransferTimeout(f"group with {peer_id!r} (gen {latest}) failed: {e}") from e
            pair = Pair(peer_id, latest, pg, peer_rank=1, store=client,
                        num_heads=heads[1] - heads[0])
            with self._lock:
                self._pairs[peer_id] = pair
            return pair

    def _read_channel(self, pair: Pair, peer: _Peer) -> None:
        """Read (header, payload) messages in order until the pair breaks (RuntimeError: the
        peer died, or the pair was discarded, which closes it). An idle pair keeps its
        header receive posted: that wait is what notices the peer's death."""
        layout = self.layout
        hdr = empty_header(self.device)
        work = pair.pg.recv([hdr], pair.peer_rank, DATA_TAG)
        while True:
            work.wait(FOREVER)
            h = Header.decode(hdr)
            buf = None
            if h.has_payload:
                buf = torch.empty((2, h.num_tokens, pair.num_heads, layout.row_width),
                                  dtype=layout.torch_dtype, device=self.device)
                pair.pg.recv([buf], pair.peer_rank, DATA_TAG).wait(FOREVER)
            # Post the next header's receive before handing this layer over, so the sender
            # never waits on our callback.
            hdr = empty_header(self.device)
            work = pair.pg.recv([hdr], pair.peer_rank, DATA_TAG)
            self._deliver(peer, pair, h, buf)

    def _deliver(self, peer: _Peer, pair: Pair, h: Header, kv: torch.Tensor | None) -> None:
        with self._lock:
            tr = peer.transfers.get(h.transfer_id)
            if tr is None or tr.done.is_set():
                self.dropped_messages += 1  # aborted, timed out or failed: its late data goes
                return
        if h.layer == ABORT_LAYER:
            tr.fail(KVTransferError(f"prefill worker {peer.peer_id!r} aborted the KV transfer "
                                    f"for {tr.spec.request_id!r}"))
            return
        if (h.layer != tr.num_layers_done or h.num_tokens != tr.spec.num_tokens
                or pair.num_heads != tr.spec.num_heads):
            raise KVProtocolError(
                f"KV channel from {peer.peer_id!r} out of step: got layer {h.layer} of "
                f"{h.num_tokens} tokens x {pair.num_heads} heads for {tr.spec.request_id!r}, "
                f"expected layer {tr.num_layers_done} of {tr.spec.num_tokens} x "
                f"{tr.spec.num_heads}")
        tr.pair_gen = pair.gen
        tr.progress_at = time.monotonic()
        try:
            tr.on_layer(h.layer, kv)
        except Exception as e:
            tr.fail(KVTransferError(f"on_layer({h.layer}) raised: {e!r}"))
            return
        tr.num_layers_done += 1
        if tr.num_layers_done == tr.spec.layout.num_layers:
            tr.complete()

    def _check_stalls(self, now: float) -> None:
        """A transfer whose first layer arrived but whose next one has not within the timeout
        has stalled (the link went down mid-transfer): fail it and retire its pair, so the
        sender builds a new generation next time instead of reusing a half-dead connection.
        A transfer that never started is the lease's business, not this one's."""
        with self._lock:
            stalled = [tr for tr in self._transfers.values()
                       if tr.progress_at is not None and not tr.done.is_set()
                       and now - tr.progress_at > self.timeout_s]
        for tr in stalled:
            tr.fail(KVTransferTimeout(
                f"KV from {tr.peer_id!r} for {tr.spec.request_id!r} stalled after "
                f"{tr.num_layers_done} of {tr.spec.layout.num_layers} layers "
                f"(no layer for {self.timeout_s:g}s)"))
            self._discard_gen(tr.peer_id, tr.pair_gen)
