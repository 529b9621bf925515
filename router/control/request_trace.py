"""The router's spans of one request (worker_protocol.tracing): the root, and one span per
phase of its lifecycle, each a child of the root, one after the other:

    <operation> <model>            the root (SERVER), from acceptance to the last chunk
      route                        choosing the pair (waiting for KV capacity included)
      reserve                      the decode worker holds pages for the KV
      prefill                      prefix pulls + the prefill call; the prefill worker's
        prefill.queue / prefill.compute / kv_transfer    spans hang here
      decode                       commit + every token to the last; the decode worker's
        decode.kv_wait / decode.generate                 spans hang here

Colocated: ``route`` then ``decode`` (the worker's ``decode.generate`` includes the prompt).
A stream rebuilt on a decode worker after a migration: ``route``, ``pull`` (when another worker
holds part of its prompt: router.control.prefix_pull), then ``decode``.
A migrated stream's ``decode`` ends with the reason and the next attempt's phases follow, so
the root's children still sum to its duration. Attribute names follow the OpenTelemetry
``gen_ai`` conventions where they have one, ``pdcluster.*`` otherwise.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from engine.contract import SamplingParams
from worker_protocol.tracing import Tracing, close_request_span, end, open_request_span


class RequestTrace:
    """Open with ``RequestTrace.open`` (None when tracing is off); the orchestrator owns it
    and calls ``close`` on every path."""

    def __init__(self, tracing: Tracing, root: Any) -> None:
        self.tracing = tracing
        self.root = root
        self.decode: Any = None  # the decode phase in progress (ended by a migration too)

    @classmethod
    def open(cls, tracing: Tracing | None, request_id: str, model_id: str, chat: bool,
             num_prompt_tokens: int, params: SamplingParams,
             traceparent: str | None, user: str | None = None) -> RequestTrace | None:
        """The root span, under the client's ``traceparent`` when it sent a valid one;
        ``user``: the client's end user (``enduser.id``)."""
        if tracing is None:
            return None
        return cls(tracing, open_request_span(tracing, request_id, model_id, chat,
                                              num_prompt_tokens, params, traceparent, user))

    def phase(self, name: str, attributes: dict[str, Any] | None = None) -> Any:
        """A phase span under the root; end it with ``worker_protocol.tracing.end``."""
        return self.tracing.start(name, self.root, attributes)

    def header(self, span: Any) -> str:
        """``span``'s traceparent for the worker that does its work."""
        return self.tracing.header(span)

    def start_decode(self, worker_id: str) -> str:
        """Open the decode phase on ``worker_id``; returns its traceparent for the worker."""
        self.end_decode()
        self.decode = self.phase("decode", {"pdcluster.worker_id": worker_id})
        return self.header(self.decode)

    def end_decode(self, error: str | BaseException | None = None) -> None:
        end(self.decode, error)
        self.decode = None

    async def decode_call(self, worker_id: str, call: Callable[[str], Awaitable[Any]]) -> Any:
        """Open the decode phase on ``worker_id`` and return ``await call(traceparent)`` (the
        commit or the submit that starts the decode there); the phase ends failed if it
        raises, else it stays open until the stream ends (``close``) or migrates."""
        try:
            return await call(self.start_decode(worker_id))
        except BaseException as e:
            self.end_decode(e)
            raise

    def close(self, last: Any, finished: bool, migrations: int,
              error: BaseException | None) -> None:
        """End the open phase and the root; ``last``: the last chunk streamed (None: none),
        ``finished``: whether it ended the request (else it was cancelled or failed)."""
        if isinstance(error, GeneratorExit):  # the client went away: cancelled, not failed
            error = None
        self.end_decode(error)
        self.root.set_attribute("pdcluster.migrations", migrations)
        close_request_span(self.root, last.usage.completion_tokens if last and last.usage else 0,
                           last.finish_reason if finished else None, error)


async def decode_call(trace: RequestTrace | None, worker_id: str,
                      call: Callable[[str], Awaitable[Any]]) -> Any:
    """``trace.decode_call``, or ``await call("")`` when the request is untraced."""
    return await (call("") if trace is None else trace.decode_call(worker_id, call))


@contextmanager
def phase(trace: RequestTrace | None, name: str,
          attributes: dict[str, Any] | None = None) -> Iterator[Any]:
    """``with phase(stream.trace, "reserve") as span:`` a phase span around the block (None
    when untraced), ended failed when the block raises."""
    span = trace.phase(name, attributes) if trace is not None else None
    try:
        yield span
    except BaseException as e:
        end(span, e)
        raise
    end(span)
