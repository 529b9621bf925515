"""The KV transport interface shared by ``torch_dist`` (real, cross-process) and ``local``.

A ``KVSender`` lives on a prefill worker, a ``KVReceiver`` on a decode worker; both are
thread-safe. One transfer = one request's prompt KV, one message per layer.

Lifecycle on the decode side: ``expect(spec, peer_id, on_layer)`` when the router reserves
blocks, then ``wait(request_id, timeout_s)`` (or ``abort``). On the prefill side:
``send_layer`` after each layer's KV is written, ``finish`` after the last layer (or ``abort``).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from kv_transfer.protocol import KVTransferSpec, PeerAddress

# on_layer(layer, kv) with kv [2, num_tokens, num_kv_heads, head_dim]; kv is owned by the callee.
OnLayer = Callable[[int, torch.Tensor], None]


class KVSender(ABC):
    """Prefill side; one per worker."""

    @abstractmethod
    def send_layer(self, peer: PeerAddress, spec: KVTransferSpec, layer: int,
                   kv: torch.Tensor) -> None:
        """Post layer ``layer`` of ``spec`` asynchronously and return at once.

        ``kv`` is ``[2, num_tokens, num_kv_heads, head_dim]`` (contiguous, layout dtype) and must
        not be mutated until ``finish``/``abort`` returns. Raises ValueError on a bad tensor and
        KVHandshakeError if this peer already refused our layout.
        """

    @abstractmethod
    def finish(self, spec: KVTransferSpec, timeout_s: float) -> None:
        """Block until every layer of ``spec`` was delivered; all layers must have been sent.

        Raises KVTransferTimeout (the pair is torn down), KVHandshakeError, or KVTransferError.
        """

    @abstractmethod
    def abort(self, spec: KVTransferSpec) -> None:
        """Drop unsent layers of ``spec``; never raises for an unknown transfer."""

    @abstractmethod
    def close(self) -> None:
        """Tear down every group, thread and connection. Idempotent."""


class KVReceiver(ABC):
    """Decode side; one per worker."""

    @abstractmethod
    def expect(self, spec: KVTransferSpec, peer_id: str, on_layer: OnLayer) -> None:
        """Post receives for every layer of ``spec`` from prefill worker ``peer_id``; returns at once.

        ``on_layer(layer, kv)`` runs on a background thread as each layer arrives, in layer
        order. Raises ValueError for a duplicate request_id and KVHandshakeError when
        ``spec.layout`` does not match this receiver's layout.
        """

    @abstractmethod
    def wait(self, request_id: str, timeout_s: float) -> None:
        """Block until all layers arrived and ``on_layer`` ran for each.

        Raises KVTransferTimeout, KVTransferAborted (after ``abort``), KVHandshakeError, or
        KVTransferError (peer died, callback raised). The transfer is forgotten afterwards.
        """

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop waiting for ``request_id``; its late data is discarded. Unknown ids are ignored."""

    @abstractmethod
    def close(self) -> None:
        """Tear down every group, thread and the endpoint. Idempotent."""


class TransferState:
    """Completion bookkeeping for one transfer on either side (internal to the transports)."""

    def __init__(self, spec: KVTransferSpec) -> None:
        self.spec = spec
        self.done = threading.Event()
        self._lock = threading.Lock()  # orders fail() against complete()
        self.error: BaseException | None = None
        self.aborted = False
        self.num_layers_done = 0

    def fail(self, error: BaseException) -> None:
        """Record the error and wake waiters, unless the transfer already ended (completed
        or failed): a pair closing after a transfer completed must not fail it after the fact."""
        with self._lock:
            if self.done.is_set():
                return
            self.error = error
            self.done.set()

    def complete(self) -> None:
        """Every layer is through: wake waiters (no-op if the transfer already failed)."""
        with self._lock:
            self.done.set()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error
