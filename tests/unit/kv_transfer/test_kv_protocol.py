"""KV protocol: handshake refusals and the ordered channel's message headers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kv_transfer import KVHandshakeError, KVLayout
from kv_transfer.protocol import KVTransferSpec, check_layer_tensor
from kv_transfer.wire import ABORT_LAYER, HEADER_MAGIC, Header, KVProtocolError

LAYOUT = KVLayout("tiny", "float32", num_layers=3, num_kv_heads=2, head_dim=4)


@pytest.mark.parametrize("field,value", [("model_id", "other"), ("dtype", "bfloat16"),
                                         ("num_layers", 5), ("num_kv_heads", 3), ("head_dim", 8),
                                         ("kv_cache_dtype", "int8")])
def test_handshake_names_the_mismatched_field(field, value):
    prefill = dataclasses.replace(LAYOUT, **{field: value})
    with pytest.raises(KVHandshakeError, match=f"{field} differs") as ei:
        LAYOUT.check_compatible(prefill)
    assert repr(value) in str(ei.value) and repr(getattr(LAYOUT, field)) in str(ei.value)


def test_int8_layout_moves_rows_with_their_scales():
    """A layer message of an int8 layout is the pools' rows as stored: head_dim int8 values
    and a 4-byte scale per token and head, 3.2x fewer bytes than fp32 at head_dim 4 (3.76x at
    the default model's 64)."""
    int8 = dataclasses.replace(LAYOUT, kv_cache_dtype="int8")
    spec = KVTransferSpec("r", 1, num_tokens=5, layout=int8)
    assert spec.layer_shape == (2, 5, 2, 4 + 4)
    assert int8.torch_dtype == torch.int8 and int8.wire_dtype == "int8"
    assert spec.layer_nbytes == 2 * 5 * 2 * (4 + 4)
    assert int8.bytes_per_token == 3 * 2 * 2 * 8
    fp = KVTransferSpec("r", 1, num_tokens=5, layout=LAYOUT)
    assert fp.layer_nbytes == 2 * 5 * 2 * 4 * 4 and LAYOUT.bytes_per_token == 3 * 2 * 2 * 16
    check_layer_tensor(spec, 0, torch.zeros(spec.layer_shape, dtype=torch.int8))
    with pytest.raises(ValueError, match="kv dtype torch.float32 != layout dtype int8"):
        check_layer_tensor(spec, 0, torch.zeros(spec.layer_shape))
    assert KVLayout.from_json(int8.to_json()) == int8
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp4' unsupported"):
        dataclasses.replace(LAYOUT, kv_cache_dtype="fp4")


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
