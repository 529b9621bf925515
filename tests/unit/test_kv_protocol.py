"""KV protocol: handshake refusals and tag uniqueness."""

from __future__ import annotations

import dataclasses

import pytest

from kv_transfer import (
    KVHandshakeError,
    KVLayout,
    make_tag,
)

LAYOUT = KVLayout("tiny", "float32", num_layers=3, num_kv_heads=2, head_dim=4)


@pytest.mark.parametrize("field,value", [("model_id", "other"), ("dtype", "bfloat16"),
                                         ("num_layers", 5), ("num_kv_heads", 3), ("head_dim", 8)])
def test_handshake_names_the_mismatched_field(field, value):
    prefill = dataclasses.replace(LAYOUT, **{field: value})
    with pytest.raises(KVHandshakeError, match=f"{field} differs") as ei:
        LAYOUT.check_compatible(prefill)
    assert repr(value) in str(ei.value) and repr(getattr(LAYOUT, field)) in str(ei.value)


def test_tags_unique_across_transfers_and_layers():
    tags = {make_tag(t, layer) for t in range(2000) for layer in range(64)}
    assert len(tags) == 2000 * 64
    with pytest.raises(ValueError):
        make_tag(0, 1024)
