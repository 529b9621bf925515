"""The tests' cuttable proxy must really cut: a client idle in recv() sees its connection end
at once (a proxy that only closed its own fds left such a client waiting for its deadline)."""

import socket
import time

from tests.helpers.tcp_proxy import CuttableProxy


def test_cut_ends_an_idle_connection_at_once():
    with socket.create_server(("127.0.0.1", 0)) as server:
        proxy = CuttableProxy(server.getsockname()[1])
        try:
            client = socket.create_connection(("127.0.0.1", proxy.port))
            upstream, _ = server.accept()
            upstream.sendall(b"hello")
            assert client.recv(16) == b"hello"
            client.settimeout(10)
            time.sleep(0.1)  # both pipe threads are now blocked in recv()
            proxy.cut()
            started = time.monotonic()
            try:
                data = client.recv(16)
            except ConnectionResetError:
                data = b""
            assert data == b"" and time.monotonic() - started < 2
            # New connections still go through after a cut.
            again = socket.create_connection(("127.0.0.1", proxy.port))
            upstream2, _ = server.accept()
            upstream2.sendall(b"again")
            assert again.recv(16) == b"again"
            for s in (client, upstream, again, upstream2):
                s.close()
        finally:
            proxy.close()
