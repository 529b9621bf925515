"""A worker's lifeline: a TCP listener whose connections only the process's exit closes.

The router holds one connection to every worker (``router/control/heartbeat.py``). When the
worker's process dies, however it dies (SIGKILL, the OOM killer, a crash, ``os._exit``), its
kernel closes the connection and the router reads end-of-file within milliseconds. Nothing
else gives that word as fast: Ray's calls to a restarting actor just wait for the new process
(~1.4 s after a SIGKILL), its actor table flips ~0.1 s after the death but has to be asked,
and a heartbeat has to be missed first.

It cannot raise a false alarm: a slow, busy or stopped (SIGSTOP) process keeps its sockets
open, so the lifeline stays silent and the heartbeat's silence rule is what finds a stopped
one; a network partition closes nothing either. Only ``close`` (the worker shutting down on
purpose, after the router stopped routing to it) or the process's end closes a connection.

Nothing is ever sent on a lifeline in either direction; bytes that arrive are discarded. A
listener holds at most ``max_connections`` (one per router: a restarted router opens a new
one and its old one closed with it); more are closed at once.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64


class Lifeline:
    """Owned by a worker: built at start-up (binds at once), ``close`` at shutdown. ``port``
    goes into ``WorkerInfo.lifeline_port``."""

    def __init__(self, host: str, worker_id: str, max_connections: int = MAX_CONNECTIONS) -> None:
        self.worker_id = worker_id
        self.max_connections = max_connections
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._connections: set[socket.socket] = set()
        # close() wakes the selector through this pair instead of waiting for a timeout.
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"{worker_id}-lifeline")
        self._thread.start()

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    def close(self) -> None:
        """Close the listener and every connection (the routers holding one read EOF)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5.0)
        for sock in [*self._connections, self._listener, self._wake_r, self._wake_w]:
            sock.close()
        self._connections.clear()
        self._selector.close()

    def _serve(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._selector.select():
                    sock = key.fileobj
                    if sock is self._listener:
                        self._accept()
                    elif sock is not self._wake_r:
                        self._drain(sock)
        except Exception:  # a lifeline that broke must not take the worker with it
            # Its sockets stay open (close() or the process's end closes them), so a router
            # holding one still reads this process's end and never a false one; routers that
            # connect from now on wait in the listen backlog, which closes the same way.
            log.exception("%s: lifeline listener failed; its connections stay open until "
                          "the process ends", self.worker_id)

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(self._connections) >= self.max_connections:
            conn.close()
            return
        conn.setblocking(False)
        self._connections.add(conn)
        self._selector.register(conn, selectors.EVENT_READ)

    def _drain(self, conn: socket.socket) -> None:
        """Discard what arrived; the peer closing (EOF, reset) ends the connection here."""
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._selector.unregister(conn)
            self._connections.discard(conn)
            conn.close()
