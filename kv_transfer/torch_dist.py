"""Cross-process KV transport over pairwise torch.distributed groups (gloo on CPU, NCCL on GPU).

The decode worker (``TorchDistReceiver``) hosts a TCPStore; each prefill worker
(``TorchDistSender``) connects to it as a client. Every (prefill, decode) pair gets its own
2-rank group (rank 0 = decode, rank 1 = prefill) over
``PrefixStore(f"pair/{prefill_id}/{decode_id}/{generation}")``: no global world, no
``init_process_group``. Groups are built lazily, cached per peer, and discarded (the next
transfer uses generation + 1) when a transfer fails, times out or the peer dies.

Store keys (all in the decode worker's store, per prefill id ``p``):
  ``kv/{p}/gen``            counter; the sender bumps it to propose a new generation g
  ``kv/{p}/{g}/layout``     the sender's KVLayout (JSON)
  ``kv/{p}/{g}/verdict``    the receiver's "ok" or the handshake refusal message
  ``kv/{p}/{g}/retired``    set by whichever side discards generation g

Facts about gloo this design follows (measured on torch 2.13): ``Work.is_completed()`` never
turns true for send/recv and ``get_future()`` is unsupported, so completion is observed by a
thread blocked in ``Work.wait``; a wait that times out closes the whole pair, and neither
``abort()`` nor ``shutdown()`` wakes a blocked wait. Hence waits on data use a very long
timeout and run on background threads, deadlines are enforced in Python, and a group is torn
down deliberately by timing out a receive on the reserved ``KILL_TAG`` (which closes the
connection and wakes every blocked wait on both sides).

NCCL ignores tags (messages match in posting order), so the NCCL path is only correct when
both sides post transfers in the same order; the gloo path has no such restriction.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from kv_transfer.endpoints import LOCAL, listening_store, probe, unreachable
from kv_transfer.pairs import Pair, PairOwner, build_group, gen_key, store_key
from kv_transfer.protocol import (
    KVHandshakeError,
    KVLayout,
    KVPeerUnreachableError,
    KVTransferAborted,
    KVTransferError,
    KVTransferSpec,
    KVTransferTimeout,
    check_layer_tensor,
    make_tag,
)
from kv_transfer.transport import KVReceiver, KVSender, OnLayer, PeerAddress, TransferState

_FOREVER = datetime.timedelta(days=7)  # a data wait must never be what closes a pair
_OWN_STORE_TIMEOUT_S = 60.0
_POLL_S = 0.005
_RECENT_ABORTS = 4096


class _RecvTransfer(TransferState):
    def __init__(self, spec: KVTransferSpec, peer_id: str, on_layer: OnLayer) -> None:
        super().__init__(spec)
        self.peer_id = peer_id
        self.on_layer = on_layer
        self.aborted_at: float | None = None
        self.pair: Pair | None = None
        self.thread: threading.Thread | None = None
        # When the last layer landed (None until the first): a started transfer that then
        # waits longer than the timeout for its next layer has stalled (a cut link).
        self.progress_at: float | None = None


class TorchDistReceiver(PairOwner, KVReceiver):
    """Decode side: hosts the TCPStore (``.address``) and receives from any prefill worker."""

    def __init__(self, worker_id: str, layout: KVLayout, host: str = LOCAL, port: int = 0,
                 device: str | torch.device = "cpu", timeout_s: float = 30.0,
                 orphan_ttl_s: float = 60.0) -> None:
        """``host``: the address other hosts reach this worker at; it is advertised (with the
        store's port) as ``.address``, gloo binds it, and the store listens on it alone (a
        TCPStore of its own would listen on every interface: anyone reaching any of them
        could write its keys)."""
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
        self._threads: set[threading.Thread] = set()
        self._aborted: deque[str] = deque(maxlen=_RECENT_ABORTS)
        self._last_gen: dict[str, int] = {}  # newest generation joined (or refused) per peer
        super().__init__(worker_id, layout, device, timeout_s, orphan_ttl_s)

    def _control_store(self, pair: Pair) -> dist.Store | None:
        return self._store

    def _sget(self, fn, *args):
        with self._store_lock:
            return getattr(self._store, fn)(*args)

    def expect(self, spec: KVTransferSpec, peer_id: str, on_layer: OnLayer) -> None:
        self.layout.check_compatible(spec.layout)
        tr = _RecvTransfer(spec, peer_id, on_layer)
        with self._lock:
            if self._closed.is_set():
                raise KVTransferError("receiver is closed")
            if spec.request_id in self._transfers:
                raise ValueError(f"transfer for request {spec.request_id!r} already expected")
            # Two in-flight transfers from one peer with one tag would each take the other's
            # layers (silently wrong KV); refuse the second instead.
            tag = make_tag(spec.transfer_id, 0)
            clash = next((t.spec.request_id for t in self._transfers.values()
                          if t.peer_id == peer_id and make_tag(t.spec.transfer_id, 0) == tag),
                         None)
            if clash is not None:
                raise ValueError(f"transfer id {spec.transfer_id} from {peer_id!r} is already "
                                 f"in flight (request {clash!r})")
            self._transfers[spec.request_id] = tr
            tr.thread = threading.Thread(target=self._run, args=(tr,), daemon=True,
                                         name=f"kv-recv-{spec.request_id}")
            self._threads.add(tr.thread)
        tr.thread.start()

    def _pair_for(self, peer_id: str, deadline: float) -> Pair:
        """The live group with peer_id, joining the sender's newest generation if needed."""
        with self._peer_lock(peer_id):
            with self._lock:
                pair = self._pairs.get(peer_id)
            latest = self._sget("add", gen_key(peer_id), 0)
            if pair is not None and not pair.dead:
                if latest == pair.gen and not self._sget("check", [store_key(peer_id, pair.gen, "retired")]):
                    return pair
                self._discard(pair, self._store)  # the sender moved on or retired it
            last = self._last_gen.get(peer_id, 0)
            while (latest := self._sget("add", gen_key(peer_id), 0)) <= last:
                if time.monotonic() > deadline or self._closed.is_set():
                    raise KVTransferTimeout(f"prefill worker {peer_id!r} never connected")
                time.sleep(_POLL_S)
            self._last_gen[peer_id] = latest
            layout_key = store_key(peer_id, latest, "layout")
            while not self._sget("check", [layout_key]):
                if time.monotonic() > deadline:
                    raise KVTransferTimeout(f"prefill worker {peer_id!r} sent no layout")
                time.sleep(_POLL_S)
            theirs = KVLayout.from_json(self._sget("get", layout_key))
            try:
                self.layout.check_compatible(theirs)
            except KVHandshakeError as e:
                self._sget("set", store_key(peer_id, latest, "verdict"), "refused:" + str(e))
                raise
            self._sget("set", store_key(peer_id, latest, "verdict"), "ok")
            client = dist.TCPStore(self._own_host, self.address.port, None, False,
                                   self._own_timeout)
            try:
                pg = build_group(client, peer_id, self.worker_id, latest, 0, self.device,
                                  self._host, max(deadline - time.monotonic(), 0.1))
            except RuntimeError as e:
                raise KVTransferTimeout(f"group with {peer_id!r} (gen {latest}) failed: {e}") from e
            pair = Pair(peer_id, latest, pg, peer_rank=1, store=client)
            with self._lock:
                self._pairs[peer_id] = pair
            return pair

    def _run(self, tr: _RecvTransfer) -> None:
        spec = tr.spec
        pair = None
        try:
            pair = self._pair_for(tr.peer_id, time.monotonic() + self.timeout_s)
            with pair.lock:
                if tr.done.is_set() or pair.dead:
                    return
                bufs = [torch.empty(spec.layer_shape, dtype=spec.layout.torch_dtype,
                                    device=self.device) for _ in range(spec.layout.num_layers)]
                works = [pair.pg.recv([b], 1, make_tag(spec.transfer_id, i))
                         for i, b in enumerate(bufs)]
                pair.posted.add(tr)
                tr.pair = pair
            for layer, (buf, work) in enumerate(zip(bufs, works, strict=True)):
                work.wait(_FOREVER)  # [2, T, H, D] lands in buf
                tr.progress_at = time.monotonic()
                if tr.done.is_set():
                    continue  # aborted/failed: keep draining so no posted op outlives its buffer
                try:
                    tr.on_layer(layer, buf)
                except Exception as e:
                    tr.fail(KVTransferError(f"on_layer({layer}) raised: {e!r}"))
                    continue
                tr.num_layers_done += 1
            tr.done.set()
        except KVTransferError as e:
            tr.fail(e)
        except KVHandshakeError as e:
            tr.fail(e)
        except RuntimeError as e:  # gloo: peer died or the pair was torn down
            if pair is not None:
                self._discard(pair, self._store)
            tr.fail(KVTransferError(f"KV transfer from {tr.peer_id!r} failed: {e}"))
        finally:
            if pair is not None:
                with pair.lock:
                    pair.posted.discard(tr)
            with self._lock:
                self._threads.discard(threading.current_thread())

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
            if tr.pair is not None:
                self._discard(tr.pair, self._store)

    def wait(self, request_id: str, timeout_s: float) -> None:
        with self._lock:
            tr = self._transfers.get(request_id)
            was_aborted = request_id in self._aborted
        if tr is None:
            if was_aborted:
                raise KVTransferAborted(f"transfer for request {request_id!r} was aborted")
            raise ValueError(f"no transfer expected for request {request_id!r}")
        finished = tr.done.wait(timeout_s)
        with self._lock:
            self._transfers.pop(request_id, None)
        if not finished:
            tr.aborted_at = time.monotonic()
            tr.fail(KVTransferTimeout(f"KV for request {request_id!r} not complete after {timeout_s}s"))
            if tr.pair is not None:  # a stuck transfer: discard the pair (brief §5)
                self._discard(tr.pair, self._store)
        tr.raise_if_failed()

    def abort(self, request_id: str) -> None:
        with self._lock:
            tr = self._transfers.pop(request_id, None)
            if tr is not None:
                self._aborted.append(request_id)
        if tr is not None:
            tr.aborted = True
            tr.aborted_at = time.monotonic()
            tr.fail(KVTransferAborted(f"transfer for request {request_id!r} was aborted"))

    def close(self) -> None:
        if self._closed.is_set():
            return
        with self._lock:
            transfers = list(self._transfers.values())
            self._transfers.clear()
        for tr in transfers:
            tr.fail(KVTransferError("receiver closed"))
        self._close_pairs()  # wakes every blocked data wait
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=self.timeout_s)
        del self._store


class _SendTransfer(TransferState):
    def __init__(self, spec: KVTransferSpec) -> None:
        super().__init__(spec)
        self.aborted_at: float | None = None
        self.num_sent = 0
        self.pair: Pair | None = None
        # (layer, kv, cuda event or None) queued by send_layer, in layer order; the transfer's
        # thread posts each send (after the event, on GPU) and waits on it before the next
        self.posted: deque[tuple[int, torch.Tensor, object]] = deque()
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None


class TorchDistSender(PairOwner, KVSender):
    """Prefill side: connects to decode workers' stores and streams layers to them."""

    def __init__(self, worker_id: str, layout: KVLayout, device: str | torch.device = "cpu",
                 timeout_s: float = 30.0, orphan_ttl_s: float = 60.0, host: str = LOCAL) -> None:
        """``host``: this worker's own KV address (gloo binds it; peers connect back to it)."""
        self._host = host
        self._stores: dict[str, dist.Store] = {}  # decode worker id -> control client
        # decode worker id -> the (host, port) its cached store client and pair belong to
        self._addresses: dict[str, tuple[str, int]] = {}
        self._store_lock = threading.Lock()
        self._transfers: dict[str, _SendTransfer] = {}
        self._refusals: dict[str, KVHandshakeError] = {}
        self._send_stream = None
        super().__init__(worker_id, layout, device, timeout_s, orphan_ttl_s)

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
                probe(peer, self.timeout_s)
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
            self._sget(peer, "set", store_key(me, gen, "layout"), self.layout.to_json())
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

    def send_layer(self, peer: PeerAddress, spec: KVTransferSpec, layer: int,
                   kv: torch.Tensor) -> None:
        check_layer_tensor(spec, layer, kv)
        refusal = self._refusals.get(peer.worker_id)
        if refusal is not None and self._addresses.get(peer.worker_id) == (peer.host, peer.port):
            raise refusal
        event = None
        if kv.is_cuda:  # the send stream must not read kv before the kernel writing it is done
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            if self._closed.is_set():
                raise KVTransferError("sender is closed")
            tr = self._transfers.get(spec.request_id)
            if tr is None:
                tr = self._transfers[spec.request_id] = _SendTransfer(spec)
                tr.thread = threading.Thread(target=self._run, args=(tr, peer), daemon=True,
                                             name=f"kv-send-{spec.request_id}")
                tr.thread.start()
            tr.num_sent += 1
        with tr.cond:
            tr.posted.append((layer, kv, event))
            tr.cond.notify()

    def _post(self, pair: Pair, spec: KVTransferSpec, layer: int, kv: torch.Tensor,
              event: object) -> object:
        tag = make_tag(spec.transfer_id, layer)
        if event is None:
            return pair.pg.send([kv], 0, tag)
        if self._send_stream is None:
            self._send_stream = torch.cuda.Stream(device=kv.device)
        self._send_stream.wait_event(event)
        with torch.cuda.stream(self._send_stream):
            kv.record_stream(self._send_stream)
            return pair.pg.send([kv], 0, tag)

    def _run(self, tr: _SendTransfer, peer: PeerAddress) -> None:
        """Post this transfer's layers as they are queued, then wait for each to complete."""
        spec, pair, pending = tr.spec, None, []
        try:
            pair = self._pair_for(peer)
            with pair.lock:
                pair.posted.add(tr)
            tr.pair = pair
            for _ in range(spec.layout.num_layers):
                with tr.cond:
                    while not tr.posted and not tr.done.is_set():
                        tr.cond.wait()
                    if not tr.posted:
                        break  # aborted before everything was queued
                    layer, kv, event = tr.posted.popleft()
                with pair.lock:
                    if pair.dead:
                        raise RuntimeError("pair torn down")
                    pending.append((self._post(pair, spec, layer, kv, event), kv))
            for work, _kv in pending:
                work.wait(_FOREVER)
                tr.num_layers_done += 1
            if tr.num_layers_done == spec.layout.num_layers:
                tr.done.set()
        except (KVTransferError, KVHandshakeError) as e:
            tr.fail(e)
        except RuntimeError as e:
            if pair is not None:
                self._discard(pair, self._stores.get(peer.worker_id))
            tr.fail(KVTransferError(f"KV send to {peer.worker_id!r} failed: {e}"))
        finally:
            if pair is not None:
                with pair.lock:
                    pair.posted.discard(tr)

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
            tr.aborted_at = time.monotonic()
            tr.fail(KVTransferTimeout(f"KV send for request {spec.request_id!r} not received "
                                      f"after {timeout_s}s"))
            if tr.pair is not None:  # a stuck transfer: discard the pair (brief §5)
                self._discard(tr.pair, self._stores.get(tr.pair.peer_id))
        tr.raise_if_failed()

    def abort(self, spec: KVTransferSpec) -> None:
        with self._lock:
            tr = self._transfers.pop(spec.request_id, None)
        if tr is not None:
            tr.aborted = True
            tr.aborted_at = time.monotonic()
            with tr.cond:
                tr.fail(KVTransferAborted(f"send for request {spec.request_id!r} was aborted"))
                tr.cond.notify()

    def close(self) -> None:
        if self._closed.is_set():
            return
        with self._lock:
            transfers = list(self._transfers.values())
            self._transfers.clear()
        for tr in transfers:
            with tr.cond:
                tr.fail(KVTransferError("sender closed"))
                tr.cond.notify()
        self._close_pairs()
        for tr in transfers:
            if tr.thread is not None:
                tr.thread.join(timeout=self.timeout_s)
        with self._store_lock:
            self._stores.clear()

