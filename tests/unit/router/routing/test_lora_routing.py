"""Routing under LoRA adapters: a worker that does not hold the request's adapter pays for
reading it (its load time at the worker's prefill rate, in prompt tokens), so workers holding
it win; and the KV index keys a prompt by the adapter, so only that adapter's cached blocks
count."""

from __future__ import annotations

from engine.lora.request import LoRARequest
from router.control.adapters import Adapter, AdapterCatalog
from router.control.chooser import WorkerChooser
from router.control.request_state import WorkerSlot
from router.routing.kv_index import KVIndex
from router.routing.policy import Routing, WorkerView
from worker_protocol import WorkerInfo, WorkerLoad
from worker_protocol.kv_events import KVEventLog

BS = 4
KEY = 0xADA


def _slot(wid: str, held: tuple[str, ...]) -> WorkerSlot:
    view = WorkerView(wid, "prefill", kv_blocks_total=1000, block_size=BS,
                      load=WorkerLoad(wid, "prefill", 0, 1000, 0, 0, lora_adapters=held))
    return WorkerSlot(WorkerInfo(wid, "prefill", "node", 1, None, 1000, BS, 4096), None, view)


def _chooser(idx: KVIndex, rate: float = 1000.0) -> WorkerChooser:
    catalog = AdapterCatalog("base", True, lambda: [], call_timeout_s=1.0)
    return WorkerChooser(Routing(), idx, 1.0, catalog, lambda wid: rate)


def _index(cached: dict[str, list[int]]) -> KVIndex:
    idx = KVIndex(hash_seed=0)
    for wid, hashes in cached.items():
        log = KVEventLog(wid, "i1", BS)
        idx.add_worker(wid, BS)
        idx.reset(log.snapshot(hashes))
    return idx


def test_workers_holding_the_adapter_win_and_base_requests_still_take_turns():
    adapter = Adapter(LoRARequest("a", 1, "/adapters/a"), key=KEY, load_s=0.5)
    slots = {"p0": _slot("p0", ("a",)), "p1": _slot("p1", ())}
    chooser = _chooser(_index({"p0": [], "p1": []}))
    prompt = list(range(3, 40))
    picks = [chooser.prefill(slots, prompt, set(), adapter)[0].info.worker_id
             for _ in range(4)]
    assert picks == ["p0"] * 4
    base = [chooser.prefill(slots, prompt, set())[0].info.worker_id for _ in range(4)]
    assert sorted(base) == ["p0", "p0", "p1", "p1"]
    # the price is the load time at the worker's rate: an adapter read in no time costs none
    free = Adapter(adapter.request, key=KEY, load_s=0.0)
    assert sorted(chooser.prefill(slots, prompt, set(), free)[0].info.worker_id
                  for _ in range(4)) == ["p0", "p0", "p1", "p1"]


def test_only_the_adapters_own_cached_blocks_count():
    prompt = list(range(3, 3 + 6 * BS + 1))
    idx = KVIndex(hash_seed=0)
    under_a, under_base = idx.prompt_hashes(prompt, BS, KEY), idx.prompt_hashes(prompt, BS)
    assert not set(under_a) & set(under_base)
    idx = _index({"p0": under_base, "p1": under_a})
    adapter = Adapter(LoRARequest("a", 1, "/adapters/a"), key=KEY, load_s=0.001)
    slots = {"p0": _slot("p0", ("a",)), "p1": _slot("p1", ("a",))}
    chooser = _chooser(idx)
    slot, work = chooser.prefill(slots, prompt, set(), adapter)
    assert slot.info.worker_id == "p1" and work == 1  # its 6 blocks, the last token computed
    slot, work = chooser.prefill(slots, prompt, set())
    assert slot.info.worker_id == "p0" and work == 1
    assert idx.match(prompt, ["p0", "p1"], KEY) == {"p1": 6}
    assert idx.match(prompt, ["p0", "p1"]) == {"p0": 6}

