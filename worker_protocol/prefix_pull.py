"""Cluster-wide prefix reuse, the workers' side: a prefill worker pulls the KV of a prompt's
prefix from another worker (prefill or decode) that holds it, instead of computing it.

The router decides (``router.control.prefix_pull``) and asks the puller; the puller owns the
whole pull, so every path frees what it holds:

1. ``PrefixPuller.pull`` reserves pages for the prefix on its engine
   (``KVConnector.reserve_prefix``: the part it holds already is pinned, not pulled), posts the
   receives for the rest on its own KV endpoint (``kv_transfer``'s receiver, the same
   layer-wise transfer a decode worker takes, here in the other direction), and asks the
   source (its Ray actor handle, from the router) to ``send_prefix``.
2. ``PrefixSource.send`` reads those positions out of the source's prefix cache
   (``KVConnector.read_prefix``, restoring second-tier blocks first) and sends them layer by
   layer from its own sender.
3. Once the source's call returned and every layer landed, the puller ``commit_prefix``-es:
   the blocks join its prefix cache (KV events tell the routers) and the request that needed
   them finds them there. Any failure (the source died or no longer holds the prefix, a
   timeout) aborts the receive and releases the pages: the caller computes the prefix.

Both endpoints start on first use (a cluster that never pulls opens nothing) and close with
the worker. Tensor-parallel workers neither pull nor serve pulls (the router never asks).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import kv_transfer
from kv_transfer import (
    KVLayout,
    KVTransferError,
    KVTransferSpec,
    PeerAddress,
)

if TYPE_CHECKING:
    import torch  # annotations only: the router imports this module's messages

_ENGINE_CALL_S = 30.0  # an engine-thread call (reserve, read, commit) answers within this


@dataclass(frozen=True)
class PullRequest:
    """Router -> the prefill worker that lacks a prefix: pull positions ``[own cached
    prefix, end)`` of ``token_ids`` (the prompt; longer than ``end``) from ``source``."""

    pull_id: str  # unique per pull (the request id and the attempt)
    token_ids: list[int]
    end: int
    source_id: str
    source: object  # the source worker's Ray actor handle
    timeout_s: float


@dataclass(frozen=True)
class PullResult:
    """What a pull did. ``error`` set: nothing of it is held, the prefix is computed."""

    pulled_tokens: int  # prefix positions that came over the wire and are now cached
    cached_tokens: int  # ... that the puller held already (pinned, not pulled)
    kv_bytes: int
    seconds: float  # reserve -> committed (or failed)
    error: str = ""


@dataclass(frozen=True)
class SendPrefixRequest:
    """Puller -> source: send ``spec``'s positions of the prompt's prefix to ``destination``."""

    token_ids: list[int]
    spec: KVTransferSpec
    destination: PeerAddress
    timeout_s: float


class _Endpoint:
    """One KV endpoint opened on first use, closed with the worker."""

    def __init__(self, make) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._endpoint = None
        self._closed = False

    def get(self):
        with self._lock:
            if self._closed:
                raise KVTransferError("the worker is shutting down")
            if self._endpoint is None:
                self._endpoint = self._make()
            return self._endpoint

    def close(self) -> None:
        with self._lock:
            self._closed = True
            endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            endpoint.close()


class PrefixPuller:
    """A prefill worker's side of pulls (see the module docstring). Thread-safe."""

    def __init__(self, loop, worker_id: str, layout: KVLayout, host: str,
                 device: str | torch.device) -> None:
        self._loop = loop
        self.layout = layout
        self._ids = itertools.count()
        # kv_transfer's endpoints load torch: looked up when the endpoint starts, so the router
        # imports this module's messages without it.
        self._receiver = _Endpoint(lambda: kv_transfer.TorchDistReceiver(
            worker_id, layout, host=host, device=device))
        self.pulled_tokens = 0  # cumulative

    def pull(self, req: PullRequest) -> PullResult:
        import ray

        t0 = time.monotonic()
        start, receiver = 0, None
        try:
            # In the try: a reservation whose answer came too late is released below too.
            res = self._call(lambda e: e.kv_connector.reserve_prefix(req.pull_id, req.token_ids,
                                                                       req.end))
            if not res.ok:
                return PullResult(0, 0, 0, time.monotonic() - t0, f"no pages: {res.reason}")
            start = res.num_cached_tokens
            if start >= req.end:  # it holds the whole prefix already
                self._release(req.pull_id)
                return PullResult(0, start, 0, time.monotonic() - t0)
            spec = KVTransferSpec(req.pull_id, next(self._ids), req.end - start, self.layout,
                                  start_token=start)
            receiver = self._receiver.get()

            def land(layer: int, kv: torch.Tensor) -> None:
                # The receiver's thread; import_layer is safe from any thread.
                self._loop.engine.kv_connector.import_layer(req.pull_id, layer, kv)

            receiver.expect(spec, req.source_id, land)
            # The source's answer first: it fails fast when it lost the prefix or died, where
            # the receive would only time out.
            ray.get(req.source.send_prefix.remote(SendPrefixRequest(
                req.token_ids, spec, receiver.address, req.timeout_s)), timeout=req.timeout_s)
            receiver.wait(req.pull_id, req.timeout_s)
            self._call(lambda e: e.kv_connector.commit_prefix(req.pull_id, req.end))
        except Exception as e:  # every failure: abort the receive, free the pages
            if receiver is not None:
                receiver.abort(req.pull_id)
            self._release(req.pull_id)
            cause = getattr(e, "cause", None) or e  # a Ray task error's own exception
            return PullResult(0, start, 0, time.monotonic() - t0,
                              f"{type(cause).__name__}: {cause}"[:300])
        self.pulled_tokens += spec.num_tokens
        return PullResult(spec.num_tokens, start, spec.layer_nbytes * self.layout.num_layers,
                          time.monotonic() - t0)

    def close(self) -> None:
        self._receiver.close()

    def _call(self, fn):
        return self._loop.call(fn).result(_ENGINE_CALL_S)

    def _release(self, pull_id: str) -> None:
        with contextlib.suppress(Exception):  # the loop is gone: so is every page
            self._call(lambda e: e.kv_connector.release(pull_id))


class PrefixSource:
    """Any worker's side of pulls: serves ``send_prefix`` from its prefix cache."""

    def __init__(self, loop, worker_id: str, layout: KVLayout, host: str,
                 device: str | torch.device, delay_per_layer_s: float = 0.0) -> None:
        self._loop = loop
        self._sender = _Endpoint(lambda: kv_transfer.TorchDistSender(worker_id, layout,
                                                                     device=device, host=host))
        self._delay_per_layer_s = delay_per_layer_s  # fault injection (tests)
        self.sent_tokens = 0  # cumulative

    def send(self, req: SendPrefixRequest) -> int:
        """Send the prefix's positions; returns the bytes sent. Raises KVTransferError when
        this worker no longer holds the prefix, or the transfer fails."""
        spec = req.spec
        layers = self._loop.call(lambda e: e.kv_connector.read_prefix(
            req.token_ids, spec.start_token, spec.prompt_len)).result(_ENGINE_CALL_S)
        if layers is None:
            raise KVTransferError(f"prefix of {spec.prompt_len} tokens no longer cached here")
        sender = self._sender.get()
        for layer, kv in enumerate(layers):
            if self._delay_per_layer_s:
                time.sleep(self._delay_per_layer_s)
            sender.send_layer(req.destination, spec, layer, kv.contiguous())
        sender.finish(spec, req.timeout_s)
        self.sent_tokens += spec.num_tokens
        return spec.layer_nbytes * len(layers)

    def close(self) -> None:
        self._sender.close()
