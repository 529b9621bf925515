"""KV protocol: handshake refusals and the ordered channel's message headers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kv_transfer import KVHandshakeError, KVLayout
from kv_transfer.wire import ABORT_LAYER, HEADER_MAGIC, Header, KVProtocolError

LAYOUT = KVLayout("tiny", "float32", num_layers=3, num_kv_heads=2, head_dim=4)


@pytest.mark.parametrize("field,value", [("model_id", "other"), ("dtype", "bfloat16"),
                                         ("num_layers", 5), ("num_kv_heads", 3), ("head_dim", 8)])
def test_handshake_names_the_mismatched_field(field, value):
    prefill = dataclasses.replace(LAYOUT, **{field: value})
    with pytest.raises(KVHandshakeError, match=f"{field} differs") as ei:
        LAYOUT.check_compatible(prefill)
    assert repr(value) in str(ei.value) and repr(getattr(LAYOUT, field)) in str(ei.value)


def test_header_round_trip_names_transfer_and_layer():
    for h in (Header(0, 0, 1), Header(2**40 + 7, 1023, 300), Header(5, ABORT_LAYER, 0)):
        t = h.encode()
        assert t.dtype == torch.int64 and t.shape == (4,)
        assert Header.decode(t) == h
    assert Header(1, 0, 16).has_payload and not Header(1, ABORT_LAYER, 0).has_payload


@pytest.mark.parametrize("words,match", [
    ([0, 1, 0, 16], "out of step"),  # not our magic: an unsynchronised channel
    ([HEADER_MAGIC, 1, 0, 0], "malformed"),  # a layer without payload
    ([HEADER_MAGIC, 1, ABORT_LAYER, 16], "malformed"),  # an abort carrying data
    ([HEADER_MAGIC, 1, -2, 0], "malformed"),
    ([HEADER_MAGIC, 1, 0, -3], "malformed"),
])
def test_a_bad_header_is_a_protocol_error(words, match):
    with pytest.raises(KVProtocolError, match=match):
        Header.decode(torch.tensor(words, dtype=torch.int64))
