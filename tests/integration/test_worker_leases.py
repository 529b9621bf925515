"""Decode-worker reservations without Ray: leases expire, handshakes refuse other models."""

from __future__ import annotations

import time

import pytest

from decode_workers.worker import DecodeWorker
from engine import EngineArgs, SamplingParams
from kv_transfer import KVHandshakeError, KVLayout, KVTransferError, KVTransferSpec
from tests.tiny_models import save_tiny_model
from worker_protocol import AbortRequest, CommitRequest, ReserveRequest, WorkerConfig


@pytest.fixture()
def decode_worker(tiny_llama_dir):
    w = DecodeWorker(WorkerConfig("decode-t", "decode", EngineArgs(model=str(tiny_llama_dir), block_size=8),
                                  lease_s=0.5, transfer_timeout_s=2.0))
    yield w
    w.shutdown()


def _reserve(worker, layout, rid="r1", n=20):
    spec = KVTransferSpec(rid, 1, n, layout)
    return worker.reserve(ReserveRequest(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=4),
                                         spec, "prefill-x"))


def test_expired_lease_frees_the_reservation(decode_worker):
    res = _reserve(decode_worker, decode_worker.layout)
    assert res.ok and res.num_blocks == 3  # 21 tokens (prompt + first token) in blocks of 8
    assert decode_worker.load().kv_blocks_reserved == 3
    deadline = time.monotonic() + 5
    while decode_worker.load().kv_blocks_used or decode_worker.load().kv_blocks_reserved:
        assert time.monotonic() < deadline, "lease did not release the blocks"
        time.sleep(0.05)
    # the KV never came: committing now is refused, and nothing is held
    with pytest.raises(KVTransferError):
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
    finally:
        other.shutdown()
    field = "num_kv_heads" if same_name else "model_id"
    with pytest.raises(KVHandshakeError, match=f"{field} differs"):
        _reserve(decode_worker, theirs, rid="r3")
    assert decode_worker.load().kv_blocks_used == 0
    assert decode_worker.load().kv_blocks_reserved == 0

