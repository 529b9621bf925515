"""Per-request traces, exported over OTLP (gRPC) with the OpenTelemetry SDK.

One trace per request: the router opens the root span (continuing the client's W3C
``traceparent`` when it sent one) and its own phase spans; each worker records the spans of
the work it did, on its own process, under the parent the router handed it as a
``traceparent`` string inside the request message (``PrefillRequest.traceparent`` and
friends). No OpenTelemetry context crosses a process any other way.

Off by default: with no endpoint (flag or ``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) nothing is
built, and callers hold ``None`` instead of a ``Tracing`` (one ``is None`` test per call
site). On, spans are queued to a background exporter (``BatchSpanProcessor``): an export that
fails or a collector that is down costs a log line, never a request. Sampling is decided once,
at the root (``sample_ratio``; a client's sampled flag is followed); workers never start a
trace of their own and record nothing for an unsampled one.

Workers time their spans with their own clocks and hand explicit start / end times to the SDK
(``record``), so no span stays open across threads or engine steps.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)

TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
TRACEPARENT = "traceparent"


@dataclass(frozen=True)
class TracingConfig:
    """Where traces go and how many. ``endpoint``: an OTLP/gRPC collector, ``http://host:port``
    (plaintext) or ``https://host:port`` (TLS); a bare ``host:port`` is plaintext."""

    endpoint: str
    sample_ratio: float = 1.0  # of root traces (a client's sampled traceparent is followed)
    export_timeout_s: float = 5.0  # one export attempt (in the background)
    flush_interval_s: float = 1.0  # how long a finished span may wait in the queue
    max_queue: int = 8192  # spans beyond it are dropped (and counted by the SDK), not held

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"trace sample ratio must be in [0, 1], got {self.sample_ratio:g}")
        url = self._url()
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"--otlp-traces-endpoint must be http(s)://host:port or "
                             f"host:port (OTLP over gRPC), got {self.endpoint!r}")
        if self.export_timeout_s <= 0 or self.flush_interval_s <= 0 or self.max_queue <= 0:
            raise ValueError("trace export timeout, flush interval and queue must be > 0")

    @classmethod
    def resolve(cls, endpoint: str | None, sample_ratio: float = 1.0) -> TracingConfig | None:
        """The flag's endpoint, else ``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else None (off)."""
        endpoint = endpoint or os.environ.get(TRACES_ENDPOINT_ENV) or None
        return None if endpoint is None else cls(endpoint, sample_ratio)

    @property
    def grpc_target(self) -> tuple[str, bool]:
        """(``host:port``, insecure) for the exporter."""
        url = self._url()
        return url.netloc, url.scheme == "http"

    def _url(self):
        """The endpoint parsed; a bare ``host:port`` reads as plaintext ``http://``."""
        return urlparse(self.endpoint if "://" in self.endpoint else f"http://{self.endpoint}")


class Tracing:
    """One process's tracer and exporter. Build with ``start_tracing``."""

    def __init__(self, config: TracingConfig, service: str, is_router: bool,
                 attributes: dict[str, Any] | None = None) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.config = config
        target, insecure = config.grpc_target
        # Only the router starts traces; a worker follows its parent's sampled flag.
        sampler = ParentBased(TraceIdRatioBased(config.sample_ratio) if is_router else ALWAYS_OFF)
        resource = Resource.create({"service.name": service, "process.pid": os.getpid(),
                                    **(attributes or {})})
        # A provider of our own, not the global one: a process may host several (tests).
        self._provider = TracerProvider(resource=resource, sampler=sampler)
        self._provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=target, insecure=insecure,
                             timeout=config.export_timeout_s),
            max_queue_size=config.max_queue,
            schedule_delay_millis=config.flush_interval_s * 1000,
            export_timeout_millis=config.export_timeout_s * 1000))
        self._tracer = self._provider.get_tracer("pdcluster")
        self._propagator = TraceContextTextMapPropagator()

    # ---- spans --------------------------------------------------------------------------
    def start(self, name: str, parent: Any = None, attributes: dict[str, Any] | None = None,
              start_ns: int | None = None, server: bool = False) -> Any:
        """Open a span; ``parent``: a span from here, a ``traceparent`` string, or None (a
        new trace). End it with ``end``."""
        from opentelemetry.trace import SpanKind

        return self._tracer.start_span(
            name, context=self._context(parent), attributes=attributes or None,
            start_time=start_ns, kind=SpanKind.SERVER if server else SpanKind.INTERNAL)

    def record(self, name: str, parent: str, start_ns: int, end_ns: int,
               attributes: dict[str, Any] | None = None, error: str | None = None) -> None:
        """A span already over, timed by the caller (``wall_ns``), under a ``traceparent``
        from another process. Nothing happens without a parent (the request is untraced)."""
        if not parent:
            return
        span = self._tracer.start_span(name, context=self._context(parent),
                                       attributes=attributes or None, start_time=start_ns)
        end(span, error, max(start_ns, end_ns))

    def header(self, span: Any) -> str:
        """The ``traceparent`` a child in another process is started under ("" when the span
        is not sampled: the child records nothing)."""
        from opentelemetry import trace

        if span is None or not span.get_span_context().trace_flags.sampled:
            return ""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get(TRACEPARENT, "")

    def shutdown(self) -> None:
        """Export what is queued (at most ``export_timeout_s``), then stop the exporter."""
        try:
            self._provider.force_flush(int(self.config.export_timeout_s * 1000))
            self._provider.shutdown()
        except Exception as e:  # a collector that is down must not fail a shutdown
            log.warning("trace exporter shutdown: %r", e)

    def _context(self, parent: Any):
        from opentelemetry import trace

        if parent is None or parent == "":
            return None
        if isinstance(parent, str):
            return self._propagator.extract({TRACEPARENT: parent})
        return trace.set_span_in_context(parent)


def start_tracing(config: TracingConfig | None, service: str, is_router: bool = False,
                  attributes: dict[str, Any] | None = None) -> Tracing | None:
    """A ``Tracing`` for this process, or None when ``config`` is None (tracing off)."""
    if config is None:
        return None
    tracing = Tracing(config, service, is_router, attributes)
    log.info("%s: exporting traces to %s (sample ratio %g)", service, config.endpoint,
             config.sample_ratio)
    return tracing


def end(span: Any, error: str | BaseException | None = None, end_ns: int | None = None) -> None:
    """End ``span`` (None: nothing), marked failed with ``error`` when given."""
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
        if isinstance(error, BaseException):
            span.record_exception(error)
    span.end(end_time=end_ns)


def wall_ns(clock_s: float, clock=time.monotonic) -> int:
    """A time on ``clock`` (seconds, e.g. an engine's monotonic clock) as wall-clock
    nanoseconds, the unit spans carry."""
    return time.time_ns() - int((clock() - clock_s) * 1e9)


# ---- the root span of a request (the router's, or the embedded engine's) --------------------------
def open_request_span(tracing: Tracing, request_id: str, model_id: str, chat: bool,
                      num_prompt_tokens: int, params: Any, traceparent: str | None,
                      user: str | None = None) -> Any:
    """A request's root span (SERVER; ``gen_ai`` attributes), under the client's
    ``traceparent`` when it sent a valid one. ``params``: its ``SamplingParams``; ``user``:
    the end user the client named (OpenAI's ``user``), as ``enduser.id``."""
    op = "chat" if chat else "text_completion"
    attrs = {"gen_ai.operation.name": op, "gen_ai.request.model": model_id,
             "gen_ai.response.id": request_id, "gen_ai.usage.input_tokens": num_prompt_tokens,
             "gen_ai.request.max_tokens": params.max_tokens,
             "gen_ai.request.temperature": params.temperature,
             "gen_ai.request.top_p": params.top_p}
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = params.seed
    if user:
        attrs["enduser.id"] = user
    return tracing.start(f"{op} {model_id}", traceparent or None, attrs, server=True)


def close_request_span(root: Any, num_output_tokens: int, finish_reason: str | None,
                       error: BaseException | None) -> None:
    """End a root span: its usage and finish reason, failed when the request did not finish
    (``finish_reason`` None: cancelled, or ``error``)."""
    root.set_attribute("gen_ai.usage.output_tokens", num_output_tokens)
    if finish_reason is not None:
        root.set_attribute("gen_ai.response.finish_reasons", (finish_reason,))
    end(root, error if error is not None else (None if finish_reason is not None
                                                else "cancelled"))
