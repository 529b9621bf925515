"""Workers without Ray: decode-worker leases expire, handshakes refuse other models, a prefill
past its deadline is given up (and freed) by the prefill worker itself."""

from __future__ import annotations

import threading
import time

import pytest

from decode_workers.worker import DecodeWorker
from engine import EngineArgs, SamplingParams
from kv_transfer import KVHandshakeError, KVLayout, KVTransferError
from prefill_workers.worker import PrefillWorker
from tests.helpers.tiny_models import save_tiny_model
from worker_protocol import (
    AbortRequest,
    CommitRequest,
    PrefillRequest,
    PrefillTimeoutError,
    ReserveRequest,
    WorkerConfig,
)


@pytest.fixture()
def decode_worker(tiny_llama_dir):
    w = DecodeWorker(WorkerConfig("decode-t", "decode", EngineArgs(model=str(tiny_llama_dir), block_size=8),
                                  lease_s=0.5, transfer_timeout_s=2.0))
    yield w
    w.shutdown()


def _reserve(worker, layout, rid="r1", n=20):
    return worker.reserve(ReserveRequest(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=4),
                                         layout, "prefill-x"))


def test_expired_lease_frees_the_reservation(decode_worker):
    res = _reserve(decode_worker, decode_worker.layout)
    assert res.ok and res.num_blocks == 3  # 21 tokens (prompt + first token) in blocks of 8
    assert decode_worker.load().kv_blocks_reserved == 3
    deadline = time.monotonic() + 5
    while decode_worker.load().kv_blocks_used or decode_worker.load().kv_blocks_reserved:
        assert time.monotonic() < deadline, "lease did not release the blocks"
        time.sleep(0.05)
    # the KV never came: committing now is refused, and nothing is held
    with pytest.raises(KVTransferError, match="no KV transfer expected for 'r1'"):
        decode_worker.commit(CommitRequest("r1", 5, timeout_s=0.2))
    assert decode_worker.load().kv_blocks_used == 0


def test_abort_releases_reservation_at_once(decode_worker):
    assert _reserve(decode_worker, decode_worker.layout, rid="r2").ok
    assert decode_worker.abort(AbortRequest("r2"))
    deadline = time.monotonic() + 2
    while decode_worker.load().kv_blocks_used:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert decode_worker.load().kv_blocks_reserved == 0


def test_transfer_ids_are_the_decode_workers_own(decode_worker):
    """Routers that know nothing of each other (active-active) reserve on one decode worker
    for one prefill worker: each reservation gets its own transfer id from the worker, so the
    two prompts' KV can never take each other's message tags (it did when each router counted
    ids itself: a stream decoded another prompt's KV)."""
    ids = []
    for rid in ("from-router-a", "from-router-b", "from-router-a-2"):
        res = _reserve(decode_worker, decode_worker.layout, rid=rid)
        assert res.ok and res.transfer.request_id == rid and res.transfer.num_tokens == 20
        ids.append(res.transfer.transfer_id)
    assert len(set(ids)) == 3, ids
    for rid in ("from-router-a", "from-router-b", "from-router-a-2"):
        decode_worker.abort(AbortRequest(rid))
    deadline = time.monotonic() + 2
    while decode_worker.load().kv_blocks_used:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_no_capacity_is_a_clear_refusal(tiny_llama_dir):
    tiny_pool = 2 * 2 * 2 * 16 * 4 * 8 * 2  # two blocks of 8 tokens
    w = DecodeWorker(WorkerConfig("decode-small", "decode",
                                  EngineArgs(model=str(tiny_llama_dir), block_size=8,
                                             kv_cache_memory_bytes=tiny_pool)))
    try:
        res = _reserve(w, w.layout, n=40)
        assert not res.ok and "no KV capacity" in res.reason
        assert w.load().kv_blocks_used == 0
    finally:
        w.shutdown()


@pytest.mark.parametrize("same_name", [False, True], ids=["other-model", "same-name-other-shape"])
def test_handshake_refuses_a_different_model(decode_worker, tiny_llama_dir, tmp_path, same_name):
    # Same directory name -> same model_id, so the check must fall through to the shape.
    name = tiny_llama_dir.name if same_name else "other"
    other_dir = save_tiny_model("llama", tmp_path / name, num_key_value_heads=4)
    other = DecodeWorker(WorkerConfig("decode-o", "colocated", EngineArgs(model=str(other_dir))))
    try:
        theirs: KVLayout = other.layout
        assert other.engine.scheduler_config.max_step_prefill_tokens is None  # colocated
    finally:
        other.shutdown()
    field = "num_kv_heads" if same_name else "model_id"
    with pytest.raises(KVHandshakeError, match=f"{field} differs"):
        _reserve(decode_worker, theirs, rid="r3")
    assert decode_worker.load().kv_blocks_used == 0
    assert decode_worker.load().kv_blocks_reserved == 0



def test_prefill_past_its_deadline_is_aborted_by_the_prefill_worker(tiny_llama_dir):
    """A PrefillRequest carries its deadline: the worker stops waiting for the prompt after
    ``timeout_s``, aborts it (no pages, no queued work left) and says so with
    PrefillTimeoutError; the next prompt on the same worker is served."""
    prefill = PrefillWorker(WorkerConfig(
        "prefill-t", "prefill", EngineArgs(model=str(tiny_llama_dir), block_size=16),
        transfer_timeout_s=5.0))
    decode_worker = DecodeWorker(WorkerConfig(
        "decode-t", "decode", EngineArgs(model=str(tiny_llama_dir), block_size=8),
        lease_s=10.0, transfer_timeout_s=5.0))
    # The prompt cannot end while the gate is shut: its first layer's send waits for it (on
    # the engine's thread, where a slow step would). A prefill that returns meanwhile gave
    # up at its own deadline.
    gate = threading.Event()
    send_layer = prefill.kv.send_layer

    def gated_send_layer(*args, **kwargs):
        assert gate.wait(30), "the test never opened the gate"
        return send_layer(*args, **kwargs)

    prefill.kv.send_layer = gated_send_layer
    try:
        def prefill_one(rid, timeout_s):
            n = 20
            prompt = list(range(3, 3 + n))
            res = decode_worker.reserve(ReserveRequest(rid, prompt, SamplingParams(max_tokens=4),
                                                       decode_worker.layout, "prefill-t"))
            assert res.ok and res.kv_address == decode_worker.kv.addresses[0]
            return prefill.prefill(PrefillRequest(rid, prompt, SamplingParams(max_tokens=4),
                                                  res.transfer, res.kv_address, timeout_s))

        with pytest.raises(PrefillTimeoutError, match=r"late.*not done within 0.2 s on prefill-t"):
            prefill_one("late", 0.2)
        assert prefill.layers_sent("late") == -1  # no longer pending here
        gate.set()  # the engine's thread ends the step it was held in
        decode_worker.abort(AbortRequest("late"))  # what the router does with the reservation
        deadline = time.monotonic() + 5
        while (lo := prefill.load()).kv_blocks_used or lo.requests_running or lo.requests_waiting:
            assert time.monotonic() < deadline, f"the timed-out prompt is still held: {lo}"
            time.sleep(0.05)

        result = prefill_one("on-time", 10.0)
        assert result.request_id == "on-time" and result.kv_bytes > 0
        commit = decode_worker.commit(CommitRequest("on-time", result.first_token_id, 5.0))
        assert not commit.finished
        decode_worker.abort(AbortRequest("on-time"))
    finally:
        prefill.shutdown()
        decode_worker.shutdown()


def test_a_decode_worker_rebuilds_streams_in_short_steps_and_offers_a_lifeline(decode_worker):
    """A disaggregated decode worker computes prompts only for streams it rebuilds itself (a
    migrated one): at most DECODE_STEP_PREFILL_TOKENS a step unless its EngineArgs say
    otherwise (a colocated worker keeps its whole budget). Its info names its lifeline, which
    a router can hold open (worker_protocol.lifeline)."""
    import socket

    from decode_workers.worker import DECODE_STEP_PREFILL_TOKENS

    assert decode_worker.engine.scheduler_config.max_step_prefill_tokens == DECODE_STEP_PREFILL_TOKENS
    info = decode_worker.info()
    assert info.lifeline_port > 0
    with socket.create_connection((info.node_ip, info.lifeline_port), timeout=5.0) as conn:
        conn.settimeout(0.2)
        with pytest.raises(TimeoutError, match="timed out"):  # open, and silent
            conn.recv(1)
