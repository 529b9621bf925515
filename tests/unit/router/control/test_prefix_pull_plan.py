"""The router's pull decision (router.control.prefix_pull.PrefixPulls.plan) on a real KV index:
which worker it pulls from, how far, and when the measured rates say computing is cheaper."""

from __future__ import annotations

from kv_transfer import KVLayout
from router.control.prefix_pull import PrefixPulls
from router.control.request_state import WorkerSlot
from router.routing.kv_index import KVIndex
from router.routing.policy import WorkerView
from worker_protocol import WorkerInfo
from worker_protocol.kv_events import KVSnapshot

LAYOUT = KVLayout("m", "float32", num_layers=30, num_kv_heads=3, head_dim=64)  # 46 KB/token
PROMPT = list(range(3, 103))  # 100 tokens


def _slot(wid: str, role: str, block_size: int, tp: int = 1) -> WorkerSlot:
    info = WorkerInfo(wid, role, "node", 1, LAYOUT, 64, block_size, 512, tp_size=tp)
    return WorkerSlot(info, None, WorkerView(wid, role, 64, block_size))


def _index(holdings: dict[str, tuple[int, int]]) -> KVIndex:
    """worker id -> (block size, leading prompt tokens it holds)."""
    index = KVIndex(0)
    for wid, (bs, tokens) in holdings.items():
        index.add_worker(wid, bs)
        hashes = index.prompt_hashes(PROMPT, bs)[:tokens // bs]
        index.reset(KVSnapshot(wid, "inc", 0, bs, tuple(hashes)))
    return index


def test_it_pulls_the_longest_run_cut_to_the_pullers_blocks():
    p0, p1, d0 = _slot("p0", "prefill", 16), _slot("p1", "prefill", 16), _slot("d0", "decode", 8)
    pulls = PrefixPulls(_index({"p0": (16, 16), "p1": (16, 48), "d0": (8, 88)}), LAYOUT)
    plan = pulls.plan(PROMPT, p0, [p0, p1, d0])
    # The decode worker holds 88 tokens; the puller caches whole blocks of 16: [16, 80).
    assert plan.source is d0 and (plan.have, plan.end) == (16, 80) and plan.pull


def test_a_tie_goes_to_a_prefill_worker_and_nothing_shorter_than_a_block_moves():
    p0, p1, d0 = _slot("p0", "prefill", 8), _slot("p1", "prefill", 8), _slot("d0", "decode", 8)
    pulls = PrefixPulls(_index({"p1": (8, 48), "d0": (8, 48)}), LAYOUT)
    assert pulls.plan(PROMPT, p0, [d0, p1, p0]).source is p1
    pulls = PrefixPulls(_index({"p0": (8, 40), "p1": (8, 47)}), LAYOUT)
    assert pulls.plan(PROMPT, p0, [p0, p1]) is None  # 7 more tokens: not one whole block


def test_auto_computes_when_the_measured_rates_say_so_and_off_never_pulls():
    p0, p1 = _slot("p0", "prefill", 16), _slot("p1", "prefill", 16)
    index = _index({"p1": (16, 96)})
    pulls = PrefixPulls(index, LAYOUT)
    assert pulls.plan(PROMPT, p0, [p0, p1]).pull  # priors: 200 MB/s vs 1,000 tokens/s
    pulls.note_prefill("p0", 5000, 0.1)  # a fast prefill worker: 50,000 tokens/s
    slow = pulls.plan(PROMPT, p0, [p0, p1])
    assert not slow.pull and slow.est_transfer_s > slow.est_recompute_s
    assert PrefixPulls(index, LAYOUT, mode="always").plan(PROMPT, p0, [p0, p1]).pull
    assert PrefixPulls(index, LAYOUT, mode="off").plan(PROMPT, p0, [p0, p1]) is None


def test_tensor_parallel_and_dead_workers_take_no_part():
    p0, p1 = _slot("p0", "prefill", 16), _slot("p1", "prefill", 16, tp=2)
    pulls = PrefixPulls(_index({"p1": (16, 96)}), LAYOUT)
    assert pulls.plan(PROMPT, p0, [p0, p1]) is None
    p2 = _slot("p2", "prefill", 16)
    p2.view.alive = False
    pulls = PrefixPulls(_index({"p2": (16, 96)}), LAYOUT)
    assert pulls.plan(PROMPT, p0, [p0, p2]) is None


def test_a_busy_prefill_source_counts_its_queue_and_loses_a_tie_to_a_decode_worker():
    """A source reads the prefix between its engine steps: a prefill worker computing other
    prompts answers once its step ends. The plan adds that wait (its prompts in flight at its
    measured rate) to the transfer, and among equal holders prefers a decode worker to it."""
    p0, p1, d1 = _slot("p0", "prefill", 16), _slot("p1", "prefill", 16), _slot("d1", "decode", 8)
    pulls = PrefixPulls(_index({"p1": (16, 64)}), LAYOUT)
    pulls.note_prefill("p1", 500, 1.0)  # 500 tokens/s
    idle = pulls.plan(PROMPT, d1, [p0, p1, d1])
    assert idle.source is p1 and idle.pull
    p1.view.inflight_prefill_tokens = 384  # the second wave: ~0.77 s before p1 can read
    busy = pulls.plan(PROMPT, d1, [p0, p1, d1])
    assert not busy.pull and busy.est_transfer_s > 0.75 > busy.est_recompute_s
    d0 = _slot("d0", "decode", 16)
    tie = PrefixPulls(_index({"p1": (16, 64), "d0": (16, 64)}), LAYOUT)
    assert tie.plan(PROMPT, d1, [p1, d0, d1]).source is d0
    p1.view.inflight_prefill_tokens = 0
    assert tie.plan(PROMPT, d1, [d0, p1, d1]).source is p1
