"""The front door's last requests, for an operator asking "which were slow just now?"
(``GET /v1/cluster``'s ``slowest_recent``, ``pdcluster top``).

``Metrics.track`` notes every request as it ends (finished, cancelled or failed); the last
``keep`` are held, nothing older. Bounded memory, one deque append per request.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RecentRequest:
    request_id: str
    api: str  # "grpc" | "http"
    ended_at: float  # wall clock (seconds since the epoch)
    e2e_s: float  # the front door's: arrival to its last chunk (or its end)
    ttft_s: float | None  # None: ended before a first token
    output_tokens: int
    finish_reason: str  # "stop" | "length" | "abort" | ... | "cancelled" | "error"
    user: str | None = None  # OpenAI's ``user``, as the client sent it (None: none)


class RecentRequests:
    def __init__(self, keep: int = 512) -> None:
        self._last: deque[RecentRequest] = deque(maxlen=keep)

    def note(self, r: RecentRequest) -> None:
        self._last.append(r)

    def slowest(self, n: int = 10, within_s: float = 300.0) -> list[dict]:
        """The ``n`` longest (end to end) of those that ended in the last ``within_s``
        seconds, slowest first, as JSON-ready dicts."""
        since = time.time() - within_s
        recent = [r for r in list(self._last) if r.ended_at >= since]
        return [asdict(r) for r in sorted(recent, key=lambda r: r.e2e_s, reverse=True)[:n]]
