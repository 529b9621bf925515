"""Moving one request's prompt KV from a prefill worker to a decode worker, layer by layer."""

from kv_transfer.protocol import (
    KVHandshakeError,
    KVLayout,
    KVPeerUnreachableError,
    KVTransferAborted,
    KVTransferError,
    KVTransferSpec,
    KVTransferTimeout,
)
from kv_transfer.torch_dist import TorchDistReceiver, TorchDistSender
from kv_transfer.transport import KVReceiver, KVSender, OnLayer, PeerAddress

__all__ = [
    "KVHandshakeError", "KVLayout", "KVPeerUnreachableError", "KVReceiver", "KVSender", "KVTransferAborted",
    "KVTransferError", "KVTransferSpec", "KVTransferTimeout", "OnLayer", "PeerAddress",
    "TorchDistReceiver", "TorchDistSender",
]
