"""KV protocol: handshake refusals, tag uniqueness, and LocalKVChannel semantics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kv_transfer import (
    KVHandshakeError,
    KVLayout,
    KVTransferAborted,
    KVTransferSpec,
    KVTransferTimeout,
    LocalKVChannel,
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


def _kv(spec, layer):
    return torch.full(spec.layer_shape, float(layer + 10 * spec.transfer_id))


def test_local_channel_end_to_end_abort_and_timeout():
    ch = LocalKVChannel()
    rx, tx = ch.receiver("d0", LAYOUT), ch.sender("p0", LAYOUT)
    try:
        got = []
        a = KVTransferSpec("a", 1, 5, LAYOUT)
        # data sent before expect() is held, like a posted send
        tx.send_layer(rx.address, a, 0, _kv(a, 0))
        rx.expect(a, "p0", lambda layer, kv: got.append((layer, kv)))
        for layer in (1, 2):
            tx.send_layer(rx.address, a, layer, _kv(a, layer))
        tx.finish(a, timeout_s=5)
        rx.wait("a", timeout_s=5)
        assert [layer for layer, _ in got] == [0, 1, 2]
        assert all(torch.equal(kv, _kv(a, layer)) for layer, kv in got)

        b = KVTransferSpec("b", 2, 3, LAYOUT)
        rx.expect(b, "p0", lambda *_: None)
        rx.abort("b")
        with pytest.raises(KVTransferAborted):
            rx.wait("b", timeout_s=1)

        c = KVTransferSpec("c", 3, 3, LAYOUT)
        rx.expect(c, "p0", lambda *_: None)
        tx.send_layer(rx.address, c, 0, _kv(c, 0))
        with pytest.raises(KVTransferTimeout):
            rx.wait("c", timeout_s=0.2)
        tx.abort(c)
    finally:
        rx.close()
        tx.close()


def test_local_channel_refuses_mismatched_sender_on_both_sides():
    ch = LocalKVChannel()
    rx = ch.receiver("d0", LAYOUT)
    bad_layout = dataclasses.replace(LAYOUT, head_dim=8)
    tx = ch.sender("p0", bad_layout)
    try:
        spec = KVTransferSpec("a", 1, 2, LAYOUT)
        rx.expect(spec, "p0", lambda *_: None)
        bad = KVTransferSpec("a", 1, 2, bad_layout)
        with pytest.raises(KVHandshakeError, match="head_dim differs"):
            tx.send_layer(rx.address, bad, 0, torch.zeros(bad.layer_shape))
        with pytest.raises(KVHandshakeError, match="head_dim differs"):
            rx.wait("a", timeout_s=1)
    finally:
        rx.close()
