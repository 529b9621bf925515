"""Where a decode worker's KV store listens, and reaching it from a prefill worker.

A TCPStore of torch's own making listens on every interface, and anyone who reaches it can
write its keys; ``listening_store`` binds the worker's KV address alone. The prefill side
probes an advertised address with one plain connect first: c10d's own connect retries past
its timeout and logs pages of C++ frames, while the probe fails once, fast, with the OS's
reason, named in a ``KVPeerUnreachableError``.
"""

from __future__ import annotations

import datetime
import logging
import socket

import torch.distributed as dist

from kv_transfer.protocol import KVPeerUnreachableError
from kv_transfer.transport import PeerAddress

__all__ = ["LOCAL", "listening_store", "probe", "unreachable"]

log = logging.getLogger(__name__)

LOCAL = "127.0.0.1"


def listening_store(host: str, port: int, timeout: datetime.timedelta
                    ) -> tuple[dist.TCPStore, str]:
    """The master TCPStore on ``host:port`` (port 0: a free one) and the address this
    process's own clients reach it at. If ``host`` is not this machine's address (behind
    NAT?), it listens on every interface, with a warning, and is reached over loopback."""
    own_host = host
    try:
        listen = socket.create_server((host, port), backlog=4096,
                                      family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        log.warning("KV address %s is not local (%s): the KV store listens on every "
                    "interface", host, e.strerror or e)
        listen = socket.create_server(("", port), backlog=4096)
        own_host = LOCAL
    try:
        store = dist.TCPStore(own_host, listen.getsockname()[1], None, True, timeout,
                              wait_for_workers=False, master_listen_fd=listen.fileno())
    except BaseException:
        listen.close()
        raise
    listen.detach()  # the store owns the descriptor now and closes it
    return store, own_host


def probe(peer: PeerAddress, timeout_s: float) -> None:
    """Connect to the peer's store once; KVPeerUnreachableError naming it if that fails."""
    try:
        socket.create_connection((peer.host, peer.port), timeout=timeout_s).close()
    except OSError as e:
        raise unreachable(peer, timeout_s, e.strerror or type(e).__name__) from None


def unreachable(peer: PeerAddress, timeout_s: float, why: str) -> KVPeerUnreachableError:
    return KVPeerUnreachableError(
        f"decode worker {peer.worker_id!r} is unreachable at its advertised KV address "
        f"{peer.host}:{peer.port}: {why} (connect timeout {timeout_s:g}s)")
