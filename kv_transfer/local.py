"""Same-process KV transport (colocated mode, tests): ``LocalKVChannel``.

Hands tensors over in memory with the semantics of ``torch_dist``: the handshake check,
asynchronous per-layer delivery on a background thread in layer order, per-transfer wait with
timeout, abort (late data discarded). Like a posted send, data sent before the receiver
``expect``s it is held until it does; ``finish`` times out if it never does.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass

import torch

from kv_transfer.protocol import (
    KVHandshakeError,
    KVLayout,
    KVTransferAborted,
    KVTransferError,
    KVTransferSpec,
    KVTransferTimeout,
    check_layer_tensor,
)
from kv_transfer.transport import KVReceiver, KVSender, OnLayer, PeerAddress, TransferState

_RECENT_ABORTS = 4096


@dataclass
class _LayerMsg:
    sender_id: str
    spec: KVTransferSpec
    layer: int
    kv: torch.Tensor  # [2, T, H, D], a private copy
    sender_state: TransferState


@dataclass
class _Expected:
    state: TransferState
    peer_id: str
    on_layer: OnLayer


class LocalKVChannel:
    """Registry that connects in-process senders to receivers by worker id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._receivers: dict[str, LocalKVReceiver] = {}

    def receiver(self, worker_id: str, layout: KVLayout) -> LocalKVReceiver:
        with self._lock:
            if worker_id in self._receivers:
                raise ValueError(f"a receiver named {worker_id!r} already exists on this channel")
            rx = LocalKVReceiver(self, worker_id, layout)
            self._receivers[worker_id] = rx
            return rx

    def sender(self, worker_id: str, layout: KVLayout) -> LocalKVSender:
        return LocalKVSender(self, worker_id, layout)

    def _lookup(self, worker_id: str) -> LocalKVReceiver:
        with self._lock:
            rx = self._receivers.get(worker_id)
        if rx is None:
            raise KVTransferError(f"no local KV receiver named {worker_id!r}")
        return rx

    def _forget(self, worker_id: str) -> None:
        with self._lock:
            self._receivers.pop(worker_id, None)


class LocalKVReceiver(KVReceiver):
    """Decode side of a LocalKVChannel; create with ``channel.receiver(worker_id, layout)``."""

    def __init__(self, channel: LocalKVChannel, worker_id: str, layout: KVLayout) -> None:
        self.worker_id = worker_id
        self.layout = layout
        self.address = PeerAddress(worker_id, "local", 0)
        self._channel = channel
        self._lock = threading.Lock()
        self._expected: dict[str, _Expected] = {}
        self._early: dict[int, list[_LayerMsg]] = {}  # transfer_id -> messages sent before expect
        self._aborted: deque[str] = deque(maxlen=_RECENT_ABORTS)
        self._queue: queue.Queue[_LayerMsg | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._deliver_loop, name=f"kv-local-{worker_id}",
                                        daemon=True)
        self._thread.start()

    def expect(self, spec: KVTransferSpec, peer_id: str, on_layer: OnLayer) -> None:
        self.layout.check_compatible(spec.layout)
        with self._lock:
            if self._closed:
                raise KVTransferError("receiver is closed")
            if spec.request_id in self._expected:
                raise ValueError(f"transfer for request {spec.request_id!r} already expected")
            self._expected[spec.request_id] = _Expected(TransferState(spec), peer_id, on_layer)
            early = self._early.pop(spec.transfer_id, [])
        for msg in early:
            self._queue.put(msg)

    def wait(self, request_id: str, timeout_s: float) -> None:
        with self._lock:
            exp = self._expected.get(request_id)
            was_aborted = request_id in self._aborted
        if exp is None:
            if was_aborted:
                raise KVTransferAborted(f"transfer for request {request_id!r} was aborted")
            raise ValueError(f"no transfer expected for request {request_id!r}")
        finished = exp.state.done.wait(timeout_s)
        with self._lock:
            self._expected.pop(request_id, None)
            if not finished:
                self._aborted.append(request_id)
        if not finished:
            raise KVTransferTimeout(
                f"KV for request {request_id!r} not complete after {timeout_s}s "
                f"({exp.state.num_layers_done}/{exp.state.spec.layout.num_layers} layers)")
        exp.state.raise_if_failed()

    def abort(self, request_id: str) -> None:
        with self._lock:
            exp = self._expected.pop(request_id, None)
            if exp is not None:
                self._aborted.append(request_id)
        if exp is not None:
            exp.state.aborted = True
            exp.state.fail(KVTransferAborted(f"transfer for request {request_id!r} was aborted"))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._expected.values())
            self._expected.clear()
            self._early.clear()
        for exp in pending:
            exp.state.fail(KVTransferError("receiver closed"))
        self._channel._forget(self.worker_id)
        self._queue.put(None)
        self._thread.join()

    # -- called by LocalKVSender ------------------------------------------------------------

    def _handshake(self, sender_id: str, sender_layout: KVLayout) -> None:
        try:
            self.layout.check_compatible(sender_layout)
        except KVHandshakeError as e:
            with self._lock:
                refused = [x for x in self._expected.values() if x.peer_id == sender_id]
            for exp in refused:
                exp.state.fail(e)
            raise

    def _post(self, msg: _LayerMsg) -> None:
        with self._lock:
            if self._closed:
                raise KVTransferError(f"KV receiver {self.worker_id!r} is closed")
            known = any(x.state.spec.transfer_id == msg.spec.transfer_id
                        for x in self._expected.values())
            if not known:
                self._early.setdefault(msg.spec.transfer_id, []).append(msg)
                return
        self._queue.put(msg)

    def _drop_early(self, transfer_id: int) -> None:
        with self._lock:
            self._early.pop(transfer_id, None)

    def _deliver_loop(self) -> None:
        while (msg := self._queue.get()) is not None:
            with self._lock:
                exp = self._expected.get(msg.spec.request_id)
            # Aborted / unknown: the data is discarded, but the send itself completed.
            if exp is not None and not exp.state.done.is_set():
                st = exp.state
                if msg.layer != st.num_layers_done:
                    st.fail(KVTransferError(f"layer {msg.layer} arrived, expected {st.num_layers_done}"))
                else:
                    try:
                        exp.on_layer(msg.layer, msg.kv)
                        st.num_layers_done += 1
                        if st.num_layers_done == st.spec.layout.num_layers:
                            st.done.set()
                    except Exception as e:  # the callback's failure fails this transfer only
                        st.fail(KVTransferError(f"on_layer({msg.layer}) raised: {e!r}"))
            msg.sender_state.num_layers_done += 1
            if msg.sender_state.num_layers_done == msg.spec.layout.num_layers:
                msg.sender_state.done.set()


class LocalKVSender(KVSender):
    """Prefill side of a LocalKVChannel; create with ``channel.sender(worker_id, layout)``."""

    def __init__(self, channel: LocalKVChannel, worker_id: str, layout: KVLayout) -> None:
        self.worker_id = worker_id
        self.layout = layout
        self._channel = channel
        self._lock = threading.Lock()
        self._transfers: dict[str, tuple[TransferState, LocalKVReceiver, int]] = {}

    def send_layer(self, peer: PeerAddress, spec: KVTransferSpec, layer: int,
                   kv: torch.Tensor) -> None:
        check_layer_tensor(spec, layer, kv)
        rx = self._channel._lookup(peer.worker_id)
        rx._handshake(self.worker_id, self.layout)
        with self._lock:
            st, _, num_sent = self._transfers.get(spec.request_id, (TransferState(spec), rx, 0))
            self._transfers[spec.request_id] = (st, rx, num_sent + 1)
        # A copy stands in for the wire: the receiver owns what it gets.
        rx._post(_LayerMsg(self.worker_id, spec, layer, kv.clone(), st))

    def finish(self, spec: KVTransferSpec, timeout_s: float) -> None:
        with self._lock:
            entry = self._transfers.get(spec.request_id)
        if entry is None:
            raise ValueError(f"finish: nothing was sent for request {spec.request_id!r}")
        st, rx, num_sent = entry
        if num_sent != spec.layout.num_layers:
            self.abort(spec)
            raise ValueError(f"finish: {num_sent} of {spec.layout.num_layers} layers were sent")
        ok = st.done.wait(timeout_s)
        with self._lock:
            self._transfers.pop(spec.request_id, None)
        if not ok:
            rx._drop_early(spec.transfer_id)
            raise KVTransferTimeout(f"KV send for request {spec.request_id!r} not received "
                                    f"after {timeout_s}s")
        st.raise_if_failed()

    def abort(self, spec: KVTransferSpec) -> None:
        with self._lock:
            entry = self._transfers.pop(spec.request_id, None)
        if entry is not None:
            entry[1]._drop_early(spec.transfer_id)

    def close(self) -> None:
        with self._lock:
            entries = list(self._transfers.values())
            self._transfers.clear()
        for st, rx, _ in entries:
            rx._drop_early(st.spec.transfer_id)
