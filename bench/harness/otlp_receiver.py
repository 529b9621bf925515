"""An OTLP/gRPC trace receiver (the tests, ``bench.studies.tracing_cost``): the collector's
TraceService on 127.0.0.1, keeping every span it is sent (the OpenTelemetry protocol itself,
not a mock of our exporter)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Span:
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    name: str
    start_ns: int
    end_ns: int
    service: str
    pid: int
    kind: int
    status: int  # 0 unset, 1 ok, 2 error
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OtlpReceiver:
    """``start()`` listens on ``port`` (a free one by default); ``stop()`` closes it, and
    ``start()`` opens the same port again (a collector that went away and came back)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._spans: list[Span] = []
        self._cond = threading.Condition()
        self._server = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 (the protocol's name)
                receiver._take(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
        if server.add_insecure_port(f"127.0.0.1:{self.port}") == 0:
            raise RuntimeError(f"OTLP receiver could not bind 127.0.0.1:{self.port}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait(5)
            self._server = None

    def _take(self, request) -> None:
        spans = []
        for rs in request.resource_spans:
            res = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(Span(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                      s.name, s.start_time_unix_nano, s.end_time_unix_nano,
                                      res.get("service.name", ""), int(res.get("process.pid", 0)),
                                      s.kind, s.status.code, _attrs(s.attributes)))
        with self._cond:
            self._spans += spans
            self._cond.notify_all()

    def spans(self, trace_id: str | None = None) -> list[Span]:
        with self._cond:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 30.0) -> list[Span]:
        """The trace's spans once every one of ``names`` arrived (AssertionError after
        ``timeout_s``, naming the missing ones)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                got = [s for s in self._spans if s.trace_id == trace_id]
                missing = names - {s.name for s in got}
                if not missing:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"trace {trace_id}: spans {sorted(missing)} never "
                                         f"arrived; got {sorted(s.name for s in got)}")
                self._cond.wait(left)
