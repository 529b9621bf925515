"""A redis-server of a test's own, on a free loopback port, that the test may kill and start
again (the machine's Redis on 6379 is never touched). Ended by its pid, never by name."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnRedis:
    def __init__(self, password: str | None = None) -> None:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not installed (CI machines have it)")
        self.port = free_port()
        self.password = password
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start (or start again, same port, empty: no persistence) and wait until it answers."""
        import redis

        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no"]
        if self.password:
            cmd += ["--requirepass", self.password]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
        client = redis.Redis(port=self.port, password=self.password, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                client.close()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def pause(self) -> None:
        """SIGSTOP, as a hung Redis: it accepts connections and never answers, so a call to
        it waits out its client's socket timeout (``kill`` still ends it)."""
        assert self._proc is not None and self._proc.poll() is None, "not running"
        os.kill(self._proc.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL, as a crashed or OOM-killed Redis: its data is gone."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait(10)
        self._proc = None
