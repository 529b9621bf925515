"""How fast KV moves between two processes of this host: one loopback TCP stream, measured for a profile.

``pdcluster profile`` (bare or ``--served``) records it in the ``EngineProfile``
(``loopback_bytes_s``): gloo's path between two workers on one machine.
"""

from __future__ import annotations

import socket
import threading
import time

__all__ = ["add_loopback", "measure_loopback_bytes_s"]


def measure_loopback_bytes_s(total_bytes: int = 64 << 20, chunk: int = 1 << 20) -> float:
    """Bytes per second one TCP stream on 127.0.0.1 carries here (gloo's path between two
    processes of one host), sent by a thread of this process."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = [0]

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            while received[0] < total_bytes:
                data = conn.recv(chunk)
                if not data:
                    break
                received[0] += len(data)

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    payload = b"\0" * chunk
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            start = time.perf_counter()
            for _ in range(total_bytes // chunk):
                s.sendall(payload)
            t.join(30)
            elapsed = time.perf_counter() - start
    finally:
        server.close()
    return received[0] / max(elapsed, 1e-9)


def add_loopback(profile, progress=lambda msg: None):
    """``profile`` (an ``EngineProfile`` of ``engine.tuning.profile.profile_engine``) with this
    host's loopback bandwidth measured into it, its ``wall_s`` counting the measurement."""
    t0 = time.perf_counter()
    profile.loopback_bytes_s = measure_loopback_bytes_s()
    progress(f"loopback: {profile.loopback_bytes_s / 1e9:.2f} GB/s")
    profile.wall_s += time.perf_counter() - t0
    return profile
