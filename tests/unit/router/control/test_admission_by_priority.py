"""The admission's prediction error per engine priority (router/control/admission.py), which
`pdcluster bench overload` reports per class."""

from __future__ import annotations

import pytest

from router.contract import GenerationChunk
from router.control.admission import Outcomes, Prediction
from router.control.request_state import StreamState


def test_errors_are_summed_per_priority_from_first_tokens_only():
    out = Outcomes()
    high = StreamState("h", priority=1, predicted=Prediction(queue_s=0.5, compute_s=0.5, room_s=0.0))
    low = StreamState("l", priority=0, predicted=Prediction(queue_s=3.0, compute_s=0.5, room_s=0.0))
    out.note(high, GenerationChunk("h", [1], "", ttft_s=1.5))  # 0.5 s late
    out.note(low, GenerationChunk("l", [1], "", ttft_s=2.5))  # 1 s early
    out.note(low, GenerationChunk("l", [2], "", ttft_s=2.5))  # a later token: not counted
    assert out.by_priority[1] == [1, pytest.approx(0.5), pytest.approx(0.5)]
    assert out.by_priority[0] == [1, pytest.approx(1.0), pytest.approx(-1.0)]
    assert (out.predictions, out.abs_error_s) == (2, pytest.approx(1.5))
