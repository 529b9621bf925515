"""WorkerAdapters' wait for a held adapter to free (max_cpu_loras 1, the one held adapter
reserved under a request, as a decode worker's reservation holds it), over a real tiny-model
LLMEngine and EngineLoop: the adapter is read from disk once however often the load is
retried, and an abort that lands before the wait began still ends it."""

from __future__ import annotations

import threading
import time

import pytest

from engine.contract import SamplingParams
from engine.lora.request import AdaptersBusyError, LoRARequest
from engine.runtime.engine_loop import EngineLoop
from engine.runtime.llm_engine import EngineArgs, LLMEngine
from tests.helpers.lora import ALL_TARGETS, save_adapter
from worker_protocol.adapters import WorkerAdapters

# Every wait's bound: a missed abort or a lost wake-up would run it out.
WAIT_S = 30.0


@pytest.fixture(scope="module")
def loras(tiny_llama_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    d = tmp_path_factory.mktemp("wait-loras")
    return {"qv": LoRARequest("qv", 1, str(save_adapter(tiny_llama_dir, "llama", d / "qv",
                                                        seed=1))),
            "all": LoRARequest("all", 2, str(save_adapter(tiny_llama_dir, "llama", d / "all",
                                                          targets=ALL_TARGETS, seed=2)))}


@pytest.fixture
def busy(tiny_llama_dir, loras):
    """A worker's adapters whose one held adapter ("qv") has a reservation under it."""
    engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir), kv_cache_memory_bytes=1 << 20,
                                  max_num_seqs=4, enable_lora=True, max_loras=1,
                                  max_cpu_loras=1))
    loop = EngineLoop(engine, lambda outs: None, name="adapter-wait-loop")
    adapters = WorkerAdapters(engine, loop, WAIT_S)
    key = adapters.ensure(loras["qv"])
    params = SamplingParams(max_tokens=1, temperature=0.0)
    res = loop.call(lambda e: e.kv_connector.reserve("held", [1, 2, 3, 4, 5], params, key,
                                                     loras["qv"])).result(WAIT_S)
    assert res.ok
    yield engine, loop, adapters
    loop.stop()


def test_a_load_waiting_for_a_busy_adapter_reads_it_once(busy, loras, monkeypatch):
    engine, loop, adapters = busy
    reads: list[str] = []
    tries, retried = [0], threading.Event()
    read_lora, load_lora = engine.read_lora, engine.load_lora

    def counted_read(req):  # the real read, counted
        reads.append(req.lora_name)
        return read_lora(req)

    def counted_load(req, adapter=None):  # the real load; its busy refusals counted
        try:
            return load_lora(req, adapter)
        except AdaptersBusyError:
            tries[0] += 1
            if tries[0] >= 3:
                retried.set()
            raise

    monkeypatch.setattr(engine, "read_lora", counted_read)
    monkeypatch.setattr(engine, "load_lora", counted_load)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(adapters.ensure(loras["all"], WAIT_S)))
    waiter.start()
    assert retried.wait(WAIT_S)  # refused three times: "qv" is in use
    assert loop.call(lambda e: e.kv_connector.release("held")).result(WAIT_S)
    waiter.join(WAIT_S)
    assert got == [engine.lora.get("all").key]  # "qv" freed, dropped; "all" held
    assert engine.lora.held_names == ("all",)
    assert reads == ["all"]  # one disk read for every try


def test_an_abort_before_the_wait_began_ends_it(busy, loras):
    engine, _, adapters = busy
    with adapters.abortable("r1") as aborted:
        adapters.cancel("r1")  # the abort lands before ensure waits
        t0 = time.monotonic()
        with pytest.raises(AdaptersBusyError):
            adapters.ensure(loras["all"], WAIT_S, aborted)
        assert time.monotonic() - t0 < WAIT_S  # ended by the abort, not its bound
    adapters.cancel("r1")  # past the block: nothing registered, nothing to end
    assert engine.lora.held_names == ("qv",)
