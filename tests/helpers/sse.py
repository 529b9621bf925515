"""Reading server-sent events in tests."""

from __future__ import annotations

from collections.abc import Iterable


def sse_events_with_ids(lines: Iterable[str]) -> list[tuple[str | None, str]]:
    """(id, data) of each SSE event in ``lines`` (an httpx response's ``iter_lines()``)."""
    events, event_id = [], None
    for line in lines:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            events.append((event_id, line[6:]))
            event_id = None
    return events
