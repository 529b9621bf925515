"""EngineLoop over a real tiny-model LLMEngine: commands on the loop thread between steps, one
sink message per step, command errors through futures, and an idempotent stop that fails
whatever is still queued."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from engine.contract import RequestOutput, SamplingParams
from engine.runtime.engine_loop import EngineLoop
from engine.runtime.llm_engine import EngineArgs, LLMEngine

TIMEOUT_S = 30


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(tiny_llama_dir), kv_cache_memory_bytes=1 << 20,
                                max_num_seqs=4))


class Sink:
    """Collects each step's outputs (as delivered) and the thread that delivered them."""

    def __init__(self) -> None:
        self.batches: queue.SimpleQueue[list[RequestOutput]] = queue.SimpleQueue()
        self.threads: set[str] = set()

    def __call__(self, outs: list[RequestOutput]) -> None:
        self.threads.add(threading.current_thread().name)
        self.batches.put(outs)

    def until_finished(self, request_ids: set[str]) -> list[list[RequestOutput]]:
        got: list[list[RequestOutput]] = []
        pending = set(request_ids)
        while pending:
            batch = self.batches.get(timeout=TIMEOUT_S)
            got.append(batch)
            pending -= {o.request_id for o in batch if o.finished}
        return got


@pytest.fixture
def loop_and_sink(engine):
    sink = Sink()
    loop = EngineLoop(engine, sink, name="test-loop")
    yield loop, sink
    loop.stop()
    assert not engine.has_unfinished_requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_outputs_arrive_once_per_step_as_a_list(loop_and_sink):
    loop, sink = loop_and_sink
    ids = {"a", "b"}
    for rid, n in (("a", 5), ("b", 3)):
        loop.call(lambda e, rid=rid, n=n: e.add_request([1, 5, 9, 11], _params(n), rid)
                  ).result(TIMEOUT_S)
    batches = sink.until_finished(ids)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    for batch in batches:
        assert isinstance(batch, list) and batch
        # one message per request per step, never one per token
        assert len({o.request_id for o in batch}) == len(batch)
        for o in batch:
            assert len(o.new_token_ids) == 1
            tokens[o.request_id] += o.new_token_ids
            assert o.token_ids == tokens[o.request_id]
    assert {rid: len(t) for rid, t in tokens.items()} == {"a": 5, "b": 3}
    assert sink.threads == {"test-loop"}


def test_commands_run_on_the_loop_thread_between_steps(loop_and_sink):
    loop, sink = loop_and_sink
    loop.call(lambda e: e.add_request([3, 4, 5], _params(300), "long")).result(TIMEOUT_S)
    sink.batches.get(timeout=TIMEOUT_S)  # the loop is stepping
    # A command sees a consistent engine: every running request's KV is settled (a step is
    # never half done), and it runs on the thread that owns the engine.
    seen = loop.call(lambda e: (threading.current_thread().name,
                                [r.num_computed_tokens + 1 == r.num_tokens
                                 for r in e.scheduler.running])).result(TIMEOUT_S)
    assert seen[0] == "test-loop"
    assert seen[1] == [True]
    # A request added mid-flight joins the running batch.
    loop.call(lambda e: e.add_request([7, 8], _params(2), "late")).result(TIMEOUT_S)
    batches = sink.until_finished({"late"})
    assert any({"long", "late"} <= {o.request_id for o in b} for b in batches)
    loop.call_and_emit(lambda e: e.abort_request("long")).result(TIMEOUT_S)
    sink.until_finished({"long"})


def test_command_errors_reach_the_caller_and_the_loop_survives(loop_and_sink):
    loop, sink = loop_and_sink
    fut = loop.call(lambda e: e.add_request([], _params(2), "empty"))
    with pytest.raises(ValueError, match="prompt is empty"):
        fut.result(TIMEOUT_S)
    with pytest.raises(ZeroDivisionError, match="division by zero"):
        loop.call(lambda e: 1 / 0).result(TIMEOUT_S)
    assert loop.alive and loop.error is None
    assert loop.call(lambda e: e.model_config.vocab_size).result(TIMEOUT_S) == 256


def test_call_and_emit_sends_abort_output_to_the_sink(loop_and_sink):
    loop, sink = loop_and_sink
    loop.call(lambda e: e.add_request([3, 4, 5], _params(200), "victim")).result(TIMEOUT_S)
    out = loop.call_and_emit(lambda e: e.abort_request("victim")).result(TIMEOUT_S)
    assert out[0].finish_reason == "abort"
    final = sink.until_finished({"victim"})[-1]
    assert [(o.request_id, o.finish_reason) for o in final if o.finished] == [("victim", "abort")]


def test_stop_is_idempotent_and_fails_pending_commands(engine):
    sink = Sink()
    loop = EngineLoop(engine, sink, name="stop-loop")
    gate = threading.Event()
    started = threading.Event()

    def block(e):
        started.set()
        gate.wait(TIMEOUT_S)
        return "ran"

    first = loop.call(block)
    assert started.wait(TIMEOUT_S)
    pending = [loop.call(lambda e, i=i: i) for i in range(3)]
    stopper = threading.Thread(target=loop.stop)
    stopper.start()
    while not loop._stopped.is_set():  # stop() has been requested ...
        stopper.join(0.01)
    gate.set()  # ... before the loop finishes the command it was running
    stopper.join(TIMEOUT_S)
    assert first.result(TIMEOUT_S) == "ran"  # the command already running completes
    for fut in pending:
        with pytest.raises(RuntimeError, match="stopped"):
            fut.result(TIMEOUT_S)
    assert not loop.alive
    loop.stop()  # second stop: no error, no hang
    with pytest.raises(RuntimeError, match="stopped"):
        loop.call(lambda e: 1).result(TIMEOUT_S)


def test_stop_of_an_idle_loop_returns_promptly(engine):
    loop = EngineLoop(engine, Sink(), name="idle-loop")
    assert loop.call(lambda e: "ok").result(TIMEOUT_S) == "ok"
    loop.stop()
    loop.stop()
    assert not loop.alive and loop.error is None


def test_a_crashing_sink_stops_the_loop_and_is_reported(engine):
    def bad_sink(outs):
        raise RuntimeError("sink broke")

    loop = EngineLoop(engine, bad_sink, name="crash-loop")
    loop.call(lambda e: e.add_request([1, 2], _params(3), "c")).result(TIMEOUT_S)
    assert loop.wait_ended(TIMEOUT_S)
    assert not loop.alive
    assert isinstance(loop.error, RuntimeError)
    with pytest.raises(RuntimeError, match="stopped"):
        loop.call(lambda e: 1).result(TIMEOUT_S)
    loop.stop()
    # The engine is left with the request; clean it up for the other tests of this module.
    engine.abort_request("c")


def test_a_crash_is_handed_to_on_crash_and_async_requests_fail_instead_of_hanging(tiny_llama_dir):
    """A loop that dies tells its owner (a worker exits so Ray sees it dead), and the
    in-process engine ends every open request with an error rather than leaving it waiting."""
    import asyncio

    from engine.contract import RequestFailedError
    from engine.runtime.async_engine import AsyncEngine

    eng = AsyncEngine(EngineArgs(model=str(tiny_llama_dir), kv_cache_memory_bytes=1 << 20))
    crashed = []
    inner = eng.loop._on_crash
    eng.loop._on_crash = lambda e: (crashed.append(e), inner(e))

    def broken_step():
        raise RuntimeError("the step blew up")

    async def run():
        gen = eng.generate([1, 2, 3], _params(50), "victim")
        first = await anext(gen)  # running
        eng.engine.step = broken_step
        with pytest.raises(RequestFailedError, match="engine loop crashed"):
            async for _ in gen:
                pass
        return first

    try:
        asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    finally:
        eng.shutdown()
    assert [str(e) for e in crashed] == ["the step blew up"]
    assert not eng.loop.alive


def test_an_idle_loop_does_its_warm_up_once_after_a_quiet_spell(monkeypatch, tiny_llama_dir):
    """A worker's lazy tokenizer loads on the loop thread once the engine has been idle for
    ``_WARM_AFTER_IDLE_S`` (not at start-up), once; a command arriving before then defers it.
    The test, not a clock, ends each quiet spell, so only the order of events is asserted."""
    import types

    import engine.runtime.engine_loop as engine_loop

    spell_s = 1e6  # marks the loop's quiet-spell waits; the test ends them, none runs out

    class QuietSpells(queue.SimpleQueue):
        """The loop's command queue: a wait of ``spell_s`` is a quiet spell, which ends with
        a command or when the test calls ``end_spell``."""

        def __init__(self) -> None:
            super().__init__()
            self.begun = 0
            self.in_spell = threading.Event()
            self._over = threading.Event()

        def get(self, block=True, timeout=None):
            if timeout != spell_s:
                return super().get(block, timeout)
            self.begun += 1
            self.in_spell.set()
            try:
                while True:
                    try:
                        return super().get(timeout=0.005)
                    except queue.Empty:
                        if self._over.is_set():
                            self._over.clear()
                            raise
            finally:
                self.in_spell.clear()  # before the command that ended it runs

        def end_spell(self) -> None:
            self._over.set()

    monkeypatch.setattr(engine_loop, "_WARM_AFTER_IDLE_S", spell_s)
    monkeypatch.setattr(engine_loop, "queue",
                        types.SimpleNamespace(SimpleQueue=QuietSpells, Empty=queue.Empty))
    eng = LLMEngine(EngineArgs(model=str(tiny_llama_dir), detokenize=False))
    warmed: list[str] = []
    warm_done = threading.Event()

    def warm() -> None:
        warmed.append(threading.current_thread().name)
        warm_done.set()

    monkeypatch.setattr(LLMEngine, "idle_warmup", property(
        lambda self: None if warmed else warm))
    loop = EngineLoop(eng, Sink(), name="warm-loop")
    commands = loop._commands
    try:
        assert commands.in_spell.wait(TIMEOUT_S)
        assert warmed == []  # not at start-up: it waits out a quiet spell first
        assert loop.call(lambda e: "busy").result(TIMEOUT_S) == "busy"
        assert commands.in_spell.wait(TIMEOUT_S)
        # The command ended the first spell without a warm-up; a new spell began after it.
        assert (commands.begun, warmed) == (2, [])
        commands.end_spell()
        assert warm_done.wait(TIMEOUT_S)
        assert warmed == ["warm-loop"]
        assert loop.call(lambda e: "after").result(TIMEOUT_S) == "after"
        # Nothing left to warm: the loop waited for that command without a quiet spell.
        assert (commands.begun, warmed) == (2, ["warm-loop"])
    finally:
        loop.stop()
        eng.close()


def test_an_engine_is_stepped_on_the_thread_it_was_built_on(tiny_llama_dir, monkeypatch):
    """One OS thread for an engine's torch work (engine.runtime.compute_thread): a second thread
    entering OpenMP regions leaves libgomp a second pool, and it stops spin-waiting."""
    from engine.runtime.async_engine import AsyncEngine
    from engine.runtime.compute_thread import ComputeThread

    compute = ComputeThread("built-here")
    built_on = compute.run(threading.get_ident)
    assert built_on != threading.get_ident()
    loop = EngineLoop(LLMEngine(EngineArgs(model=str(tiny_llama_dir))), Sink(),
                      name="x", compute=compute)
    assert loop.call(lambda e: threading.get_ident()).result(TIMEOUT_S) == built_on
    loop.stop()
    assert loop.wait_ended(TIMEOUT_S) and not compute.alive  # the loop closed its thread

    idents = []
    init = LLMEngine.__init__

    def recording_init(self, *a, **kw):
        idents.append(threading.get_ident())
        init(self, *a, **kw)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    ae = AsyncEngine(EngineArgs(model=str(tiny_llama_dir)))
    try:
        assert ae.loop.call(lambda e: threading.get_ident()).result(TIMEOUT_S) == idents[0]
        assert idents[0] != threading.get_ident()
    finally:
        ae.shutdown()


def test_a_compute_thread_hands_back_results_and_errors():
    from engine.runtime.compute_thread import ComputeThread

    c = ComputeThread("t")
    assert c.run(lambda: 41 + 1) == 42
    with pytest.raises(ZeroDivisionError, match="division by zero"):
        c.run(lambda: 1 / 0)
    c.close()
    deadline = time.monotonic() + TIMEOUT_S
    while c.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not c.alive

