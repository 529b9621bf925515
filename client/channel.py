"""The SDK's connection pieces: TLS credentials, the API key on every call, one deadline
across retries. Shared by ``Client`` and ``AsyncClient``."""

from __future__ import annotations

import functools
import time

import grpc

from client.types import DeadlineExceeded
from proto.pdcluster.v1 import generation_pb2_grpc as pb_grpc

__all__ = ["Deadline", "KeyedStub", "credentials"]


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def credentials(tls: bool, ca_file: str | None, client_cert: str | None,
                 client_key: str | None) -> grpc.ChannelCredentials | None:
    """TLS channel credentials, or None for plaintext. ``ca_file`` / a client certificate
    imply TLS; without ``ca_file`` the system's trusted roots verify the server."""
    if bool(client_cert) != bool(client_key):
        raise ValueError("give client_cert and client_key together")
    if not (tls or ca_file or client_cert):
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(ca_file),
                                        private_key=_read(client_key),
                                        certificate_chain=_read(client_cert))


class KeyedStub:
    """The Generation stub with the API key on every call (``authorization: Bearer KEY``):
    call credentials would refuse a plaintext channel, metadata works on both."""

    def __init__(self, channel, api_key: str | None) -> None:
        self._stub = pb_grpc.GenerationStub(channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)
        if self._metadata is None:
            return method
        return functools.partial(method, metadata=self._metadata)


class Deadline:
    """One deadline across retries: each attempt gets what is left."""

    def __init__(self, timeout: float | None) -> None:
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        """Seconds left (None: no deadline). Raises DeadlineExceeded when none is left."""
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("deadline expired before the call could be (re)tried",
                                   grpc.StatusCode.DEADLINE_EXCEEDED)
        return left

    def clip(self, sleep_s: float) -> float:
        return sleep_s if self.at is None else max(0.0, min(sleep_s, self.at - time.monotonic()))
