"""The SDK's retries: UNAVAILABLE with exponential backoff; RESOURCE_EXHAUSTED only when the
server said when to come back (``retry-after``: a rate limit, a deadline the queue cannot
meet), after that long and up to half again (jitter, so refused clients spread out); never
once tokens arrived, never past ``max_retries``."""

from __future__ import annotations

import grpc

from client import RetryPolicy
from client.types import retry_after_of


class _Failed:
    def __init__(self, metadata) -> None:
        self._md = metadata

    def trailing_metadata(self):
        return self._md


def test_resource_exhausted_is_retried_only_with_a_retry_after():
    p = RetryPolicy(max_retries=2)
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert p.should_retry(code, 0, False, 3.0)
    assert not p.should_retry(code, 0, False, None)  # a full queue says nothing: give up
    assert not p.should_retry(code, 0, True, 3.0)  # tokens arrived: never replayed
    assert not p.should_retry(code, 2, False, 3.0)  # out of retries
    assert p.should_retry(grpc.StatusCode.UNAVAILABLE, 0, False)
    waits = [p.backoff_s(0, 3.0) for _ in range(200)]
    assert min(waits) >= 3.0 and max(waits) <= 4.5 and max(waits) - min(waits) > 0.5


def test_retry_after_is_read_off_the_trailing_metadata():
    assert retry_after_of(_Failed((("retry-after", "7"),))) == 7.0
    assert retry_after_of(_Failed((("other", "1"),))) is None
    assert retry_after_of(_Failed(None)) is None
    assert retry_after_of(_Failed((("retry-after", "soon"),))) is None
