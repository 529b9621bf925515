"""Moving one request's prompt KV from a prefill worker to a decode worker, layer by layer.

The protocol (layouts, specs, addresses, errors) loads without torch, so a router's front
door that only reads them does not pay for it; the transports load torch when first named.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kv_transfer.protocol import (
    KVHandshakeError,
    KVLayout,
    KVPeerUnreachableError,
    KVTransferAborted,
    KVTransferError,
    KVTransferSpec,
    KVTransferTimeout,
    PeerAddress,
)

if TYPE_CHECKING:
    from kv_transfer.torch_dist import TorchDistReceiver, TorchDistSender
    from kv_transfer.transport import KVReceiver, KVSender, OnLayer

__all__ = [
    "KVHandshakeError", "KVLayout", "KVPeerUnreachableError", "KVReceiver", "KVSender", "KVTransferAborted",
    "KVTransferError", "KVTransferSpec", "KVTransferTimeout", "OnLayer", "PeerAddress",
    "TorchDistReceiver", "TorchDistSender",
]

_TORCH_BOUND = {"TorchDistReceiver": "kv_transfer.torch_dist",
                "TorchDistSender": "kv_transfer.torch_dist",
                "KVReceiver": "kv_transfer.transport", "KVSender": "kv_transfer.transport",
                "OnLayer": "kv_transfer.transport"}


def __getattr__(name: str) -> Any:
    module = _TORCH_BOUND.get(name)
    if module is None:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
