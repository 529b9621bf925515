"""Stored Responses-API responses in this process (``LocalResponseStore``): what the front
door over a backend without a cluster store (one in-process engine) keeps them in."""

from __future__ import annotations

import json
import threading
import time

__all__ = ["LocalResponseStore"]


class LocalResponseStore:
    """Stored responses in this process (the front door over a backend without a cluster
    store: one in-process engine): ``response_put`` / ``response_get`` as a ClusterStore's,
    at most ``max_entries`` (the oldest go first)."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self.max_entries = max_entries
        self._docs: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def response_put(self, key: str, doc: dict, ttl_s: float) -> None:
        with self._lock:
            self._docs.pop(key, None)
            self._docs[key] = (json.dumps(doc), time.monotonic() + ttl_s)
            while len(self._docs) > self.max_entries:
                self._docs.pop(next(iter(self._docs)))

    def response_get(self, key: str) -> dict | None:
        with self._lock:
            entry = self._docs.get(key)
        if entry is None or entry[1] <= time.monotonic():
            return None
        return json.loads(entry[0])
