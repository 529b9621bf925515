"""TorchDistSender/Receiver across real processes over gloo on 127.0.0.1 (the same lifecycle
over NCCL: tests/gpu/test_kv_transport_nccl.py).

Gloo runs the same ordered, tag-free channel as NCCL (kv_transfer.wire), so these tests
exercise the GPU path's message order: several requests' layers interleaved as a batched
prefill step sends them, aborts on either side mid-stream, and a peer lost mid-stream.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest
import torch

from kv_transfer import (
    KVHandshakeError,
    KVLayout,
    KVTransferAborted,
    KVTransferError,
    KVTransferSpec,
    PeerAddress,
    TorchDistReceiver,
    TorchDistSender,
)
from tests.helpers.async_util import wait_until

LAYOUT = KVLayout("tiny", "float32", num_layers=4, num_kv_heads=2, head_dim=8)


def layer_kv(spec: KVTransferSpec, layer: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(spec.transfer_id * 1000 + layer)
    return torch.randn(spec.layer_shape, generator=g).to(device)  # [2, T, H, D]


def _sender_main(addr: PeerAddress, layout: KVLayout, specs: list, device: str,
                 die_after_layers: int | None, results, sender_id: str = "prefill-0",
                 abort_after: dict[str, int] | None = None, die_when=None) -> None:
    """Send every spec's layers interleaved (layer 0 of each, then layer 1, ...) like a
    batched prefill step; ``abort_after[rid] = n`` aborts that transfer after n layers;
    ``die_after_layers``: crash before that layer, once ``die_when`` (an Event) is set."""
    abort_after = abort_after or {}
    sender = TorchDistSender(sender_id, layout, device=device, timeout_s=20)
    try:
        for layer in range(LAYOUT.num_layers):
            for spec in specs:
                if die_after_layers is not None and layer == die_after_layers:
                    die_when.wait(60)  # the test saw the layers so far arrive: the pair is up
                    os._exit(3)  # a crash: no close, no goodbye
                cut = abort_after.get(spec.request_id)
                if cut is not None and layer >= cut:
                    if layer == cut:
                        sender.abort(spec)
                    continue
                sender.send_layer(addr, spec, layer, layer_kv(spec, layer, device))
        for spec in specs:
            if spec.request_id not in abort_after:
                sender.finish(spec, timeout_s=20)
        results.put("ok")
    except Exception as e:
        results.put(f"{type(e).__name__}: {e}")
    finally:
        sender.close()


class Collector:
    def __init__(self) -> None:
        self.layers: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self.lock = threading.Lock()

    def on_layer(self, rid: str):
        def cb(layer: int, kv: torch.Tensor) -> None:
            with self.lock:
                self.layers.setdefault(rid, []).append((layer, kv.cpu().clone()))
        return cb


def _spawn(addr, layout, specs, device="cpu", die_after_layers=None, sender_id="prefill-0",
           abort_after=None, die_when=None):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=_sender_main, args=(addr, layout, specs, device, die_after_layers,
                                               results, sender_id, abort_after, die_when))
    p.start()
    return p, results


def _expect_all(rx, specs, col, peer="prefill-0"):
    for spec in specs:
        rx.expect(spec, peer, col.on_layer(spec.request_id))


def _check_bit_identical(col, specs):
    for spec in specs:
        got = col.layers[spec.request_id]
        assert [layer for layer, _ in got] == list(range(LAYOUT.num_layers))
        for layer, kv in got:
            assert torch.equal(kv, layer_kv(spec, layer))


def run_lifecycle(device: str, sender_device: str = "cpu") -> None:
    """Three transfers at once, bit-identical; an abort on the receiver; the next transfer
    from the same sender works. ``device``: the receiver's, ``sender_device``: the sender's
    (tests/gpu/test_kv_transport_nccl.py runs it on two GPUs)."""
    rx = TorchDistReceiver("decode-0", LAYOUT, device=device, timeout_s=20)
    try:
        col = Collector()
        specs = [KVTransferSpec(f"req-{i}", i, n, LAYOUT) for i, n in enumerate((1, 7, 300))]
        _expect_all(rx, specs, col)
        p, res = _spawn(rx.address, LAYOUT, specs, sender_device)
        for spec in specs:
            rx.wait(spec.request_id, timeout_s=30)
        assert res.get(timeout=30) == "ok"
        p.join(30)
        _check_bit_identical(col, specs)

        # abort one transfer on the receiver; the next transfer from the same sender id works
        rx.expect(KVTransferSpec("req-aborted", 10, 5, LAYOUT), "prefill-0", lambda *_: None)
        rx.abort("req-aborted")
        nxt = [KVTransferSpec("req-after-abort", 11, 9, LAYOUT)]
        _expect_all(rx, nxt, col)
        p, res = _spawn(rx.address, LAYOUT, nxt, sender_device)
        rx.wait("req-after-abort", timeout_s=30)
        assert res.get(timeout=30) == "ok"
        p.join(30)
        _check_bit_identical(col, nxt)
    finally:
        rx.close()


def test_concurrent_transfers_bit_identical_and_abort():
    run_lifecycle("cpu")


def test_the_store_listens_on_the_kv_address_alone():
    """The decode worker's TCPStore (anyone who reaches it can write its keys) listens on
    the address it advertises, not on every interface: another local address is refused."""
    import socket

    rx = TorchDistReceiver("decode-0", LAYOUT, host="127.0.0.1", timeout_s=20)
    try:
        socket.create_connection(("127.0.0.1", rx.address.port), timeout=5).close()
        with pytest.raises(ConnectionRefusedError, match="Connection refused"):
            socket.create_connection(("127.0.0.2", rx.address.port), timeout=5)
    finally:
        rx.close()


def test_interleaved_transfers_from_two_peers_with_aborts_on_both_sides():
    """Two prefill processes each stream four requests' layers interleaved into one decode
    worker. One transfer is aborted by its sender after two layers (the receiver learns at
    once, not at its lease), one by the receiver before any data (its layers are read and
    dropped). Every other transfer arrives bit-identical, in layer order; a new process with
    a sender's id is joined afresh."""
    rx = TorchDistReceiver("decode-0", LAYOUT, timeout_s=20)
    try:
        col = Collector()
        peers = {"prefill-a": [KVTransferSpec(f"a-{i}", 100 + i, n, LAYOUT)
                               for i, n in enumerate((1, 33, 7, 129))],
                 "prefill-b": [KVTransferSpec(f"b-{i}", 200 + i, n, LAYOUT)
                               for i, n in enumerate((16, 2, 64, 5))]}
        for peer, specs in peers.items():
            _expect_all(rx, specs, col, peer)
        rx.abort("b-2")  # the decode side gives up before anything arrived
        procs = [_spawn(rx.address, LAYOUT, peers["prefill-a"], sender_id="prefill-a",
                        abort_after={"a-1": 2}),
                 _spawn(rx.address, LAYOUT, peers["prefill-b"], sender_id="prefill-b")]
        with pytest.raises(KVTransferError, match="aborted the KV transfer"):
            rx.wait("a-1", timeout_s=15)
        with pytest.raises(KVTransferAborted, match="'b-2' was aborted"):
            rx.wait("b-2", timeout_s=1)
        done = [s for specs in peers.values() for s in specs if s.request_id not in ("a-1", "b-2")]
        for spec in done:
            rx.wait(spec.request_id, timeout_s=30)
        for p, res in procs:
            assert res.get(timeout=30) == "ok"
            p.join(30)
        _check_bit_identical(col, done)
        # At most what was queued before the abort (the outbox skips the rest), in order.
        assert [layer for layer, _ in col.layers.get("a-1", [])] in ([], [0], [0, 1])
        assert "b-2" not in col.layers
        assert rx.dropped_messages == LAYOUT.num_layers  # b-2's layers, read and dropped
        assert rx.live_pairs() == {}  # both senders closed their pairs on exit

        later = [KVTransferSpec("a-later", 300, 12, LAYOUT)]
        _expect_all(rx, later, col, "prefill-a")
        p, res = _spawn(rx.address, LAYOUT, later, sender_id="prefill-a")
        rx.wait("a-later", timeout_s=30)
        assert res.get(timeout=30) == "ok"
        p.join(30)
        _check_bit_identical(col, later)
    finally:
        rx.close()


def test_a_transfer_id_in_flight_is_not_given_twice():
    """A second transfer from the same peer with a transfer id already in flight could not
    be told apart by its headers: the receiver refuses it (another peer may use the id)."""
    rx = TorchDistReceiver("decode-0", LAYOUT, timeout_s=20)
    try:
        rx.expect(KVTransferSpec("first", 7, 5, LAYOUT), "prefill-0", lambda *_: None)
        with pytest.raises(ValueError, match=r"transfer id 7 from 'prefill-0' is already in "
                                             r"flight \(request 'first'\)"):
            rx.expect(KVTransferSpec("second", 7, 5, LAYOUT), "prefill-0", lambda *_: None)
        rx.expect(KVTransferSpec("other-peer", 7, 5, LAYOUT), "prefill-1", lambda *_: None)
        rx.abort("first")
        rx.abort("other-peer")
    finally:
        rx.close()


def test_layout_mismatch_refused_on_both_sides():
    rx = TorchDistReceiver("decode-0", LAYOUT, timeout_s=20)
    try:
        bad = KVLayout("tiny", "float32", num_layers=4, num_kv_heads=3, head_dim=8)
        spec = KVTransferSpec("req-bad", 1, 4, LAYOUT)
        rx.expect(spec, "prefill-0", lambda *_: None)
        p, res = _spawn(rx.address, bad, [KVTransferSpec("req-bad", 1, 4, bad)])
        with pytest.raises(KVHandshakeError, match="num_kv_heads differs"):
            rx.wait("req-bad", timeout_s=30)
        msg = res.get(timeout=30)
        p.join(30)
        assert msg.startswith("KVHandshakeError") and "num_kv_heads" in msg
    finally:
        rx.close()


def test_sender_death_fails_wait_then_fresh_sender_works():
    rx = TorchDistReceiver("decode-0", LAYOUT, timeout_s=20)
    try:
        spec = KVTransferSpec("req-dies", 1, 16, LAYOUT)
        col = Collector()
        _expect_all(rx, [spec], col)
        layers_in = mp.get_context("spawn").Event()
        p, _ = _spawn(rx.address, LAYOUT, [spec], die_after_layers=2, die_when=layers_in)
        # It dies mid-transfer, once its first two layers arrived: the pair was up. (Killed
        # sooner, its queued layers die with it and nothing ever reaches the receiver, whose
        # wait then ends only at its own timeout, proving nothing.)
        wait_until(lambda: len(col.layers.get("req-dies", [])) == 2, timeout_s=60,
                   what="the dying sender's first two layers arriving")
        layers_in.set()
        p.join(60)
        assert p.exitcode == 3
        with pytest.raises(KVTransferError, match="KV transfer from 'prefill-0' failed"):
            rx.wait("req-dies", timeout_s=45)  # the broken pair, not this wait's timeout
        fresh = [KVTransferSpec("req-fresh", 2, 16, LAYOUT)]
        _expect_all(rx, fresh, col)
        p, res = _spawn(rx.address, LAYOUT, fresh)
        rx.wait("req-fresh", timeout_s=60)
        assert res.get(timeout=30) == "ok"
        p.join(30)
        _check_bit_identical(col, fresh)
    finally:
        rx.close()


def _send_one_then_die(addr: PeerAddress, spec: KVTransferSpec) -> None:
    sender = TorchDistSender("prefill-0", LAYOUT, timeout_s=20)
    for layer in range(LAYOUT.num_layers):
        sender.send_layer(addr, spec, layer, layer_kv(spec, layer))
    sender.finish(spec, timeout_s=20)
    os._exit(3)  # before the next transfer's first layer: no close, no goodbye


def test_a_lost_sender_fails_the_transfers_it_had_not_begun_at_once():
    """A prefill worker that dies between transfers never sends the next one: the receiver
    fails it when the pair breaks, not when its wait (or the decode worker's lease) runs out."""
    rx = TorchDistReceiver("decode-0", LAYOUT, timeout_s=20)
    try:
        col = Collector()
        first, never = KVTransferSpec("first", 1, 9, LAYOUT), KVTransferSpec("never", 2, 9, LAYOUT)
        _expect_all(rx, [first, never], col)
        p = mp.get_context("spawn").Process(target=_send_one_then_die, args=(rx.address, first))
        p.start()
        rx.wait("first", timeout_s=30)
        _check_bit_identical(col, [first])
        # The broken pair's error, not the wait's own timeout ("not complete after 18s").
        with pytest.raises(KVTransferError, match="KV transfer from 'prefill-0' failed"):
            rx.wait("never", timeout_s=18)
        p.join(30)
        assert p.exitcode == 3
    finally:
        rx.close()


def test_a_tp_pair_moves_exactly_its_heads_and_a_pair_with_no_route_is_refused():
    """Decode rank 1 of 2 takes head 1 of 2 from a TP 1 prefill (route (0 -> 1, head 1)):
    the payload is that head alone, bit for bit. A prefill rank 0 of 2 (head 0 only) has no
    route to it: the handshake refuses, naming both ends, on both sides."""
    from kv_transfer.routes import KVRoute, route_spec

    rx = TorchDistReceiver("decode-0/tp1", LAYOUT, timeout_s=20, tp_size=2, tp_rank=1)
    tx = TorchDistSender("prefill-0", LAYOUT, timeout_s=20)
    bad_tx = TorchDistSender("prefill-1", LAYOUT, timeout_s=20, tp_size=2, tp_rank=0)
    try:
        whole = KVTransferSpec("req", 1, 5, LAYOUT, start_token=3)
        part = route_spec(whole, KVRoute(0, 1, (1, 2)))
        col = Collector()
        rx.expect(part, "prefill-0", col.on_layer(part.request_id))
        with pytest.raises(ValueError, match="holds 1..1"):  # heads this rank does not hold
            rx.expect(route_spec(whole, KVRoute(0, 0, (0, 1))), "prefill-0", lambda *_: None)
        for layer in range(LAYOUT.num_layers):
            tx.send_layer(rx.address, part, layer, layer_kv(whole, layer)[:, :, 1:].contiguous())
        tx.finish(part, timeout_s=20)
        rx.wait(part.request_id, timeout_s=20)
        got = col.layers[part.request_id]
        assert [layer for layer, _ in got] == list(range(LAYOUT.num_layers))
        for layer, kv in got:
            assert kv.shape == (2, 5, 1, 8) and torch.equal(kv, layer_kv(whole, layer)[:, :, 1:])

        stray = route_spec(KVTransferSpec("req2", 2, 5, LAYOUT), KVRoute(0, 1, (1, 2)))
        rx.expect(stray, "prefill-1", lambda *_: None)
        with pytest.raises(KVHandshakeError, match=r"'prefill-1' rank 0 of tp=2 .*holds none"
                                                   r".*'decode-0/tp1' rank 1 of tp=2"):
            for layer in range(LAYOUT.num_layers):
                bad_tx.send_layer(rx.address, stray, layer, torch.zeros(stray.layer_shape))
            bad_tx.finish(stray, timeout_s=20)
        with pytest.raises(KVHandshakeError, match="holds none"):
            rx.wait(stray.request_id, timeout_s=20)
    finally:
        for endpoint in (tx, bad_tx, rx):
            endpoint.close()
