"""router.control.heartbeat: a decode worker is declared silent only when both signals agree
(no heartbeat answered and no token batch for ``suspect_after_s`` while it holds streams),
once, and re-armed when it answers again. Pings are driven by a stand-in actor handle whose
answers the test releases (the Ray path: tests/integration/test_disaggregation.py, SIGSTOP)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from router.control.heartbeat import Heartbeats
from router.routing.policy import WorkerView


class _Method:
    def __init__(self, owner: _Handle) -> None:
        self.owner = owner

    def options(self, **_):
        return self

    def remote(self):
        fut = asyncio.get_running_loop().create_future()
        self.owner.pending.append(fut)
        return fut


@dataclass
class _Handle:
    pending: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ping = _Method(self)

    def answer(self) -> None:
        for f in self.pending:
            if not f.done():
                f.set_result("pong")
        self.pending.clear()


@dataclass
class _Info:
    worker_id: str


@dataclass
class _Slot:
    info: _Info
    handle: _Handle
    view: WorkerView


def _slot(wid: str) -> _Slot:
    return _Slot(_Info(wid), _Handle(), WorkerView(wid, "decode", 64, 16))


def _run(scenario) -> None:
    asyncio.run(scenario())


def test_silent_only_when_no_pong_and_no_tokens_while_holding_streams():
    async def scenario():
        stopped, busy, idle, fine = (_slot(w) for w in ("stopped", "busy", "idle", "fine"))
        tokens = {"busy": 0.0}
        silent: list[str] = []
        hb = Heartbeats(lambda: [stopped, busy, idle, fine], lambda wid: wid != "idle",
                        lambda wid: tokens.get(wid, 0.0),
                        lambda slot, why: silent.append(slot.info.worker_id), 0.25, 1.0)
        for t in (0.0, 0.5, 1.0, 1.5, 2.0):
            tokens["busy"] = 100.0 + t  # a busy worker: pings slow, tokens flowing
            fine.handle.answer()
            await asyncio.sleep(0)
            hb.check(100.0 + t)
        # "stopped" held streams and answered nothing for 1.5 s > 1 s: moved, once
        assert silent == ["stopped"]
        tokens["busy"] = 103.0
        hb.check(103.0)
        assert silent == ["stopped"] and hb.num_silent == 1
        # it comes back: re-armed; silent again only after another full second
        stopped.handle.answer()
        await asyncio.sleep(0)
        hb.check(103.2)
        assert silent == ["stopped"]
        await hb.close()

    _run(scenario)


def test_dead_or_drained_workers_are_not_watched_and_a_restarted_one_starts_afresh():
    async def scenario():
        a = _slot("a")
        silent: list[str] = []
        hb = Heartbeats(lambda: [a], lambda wid: True, lambda wid: 0.0,
                        lambda slot, why: silent.append(why), 0.25, 1.0)
        hb.check(10.0)
        a.view.alive = False
        hb.check(20.0)
        assert silent == []
        a.view.alive = True
        hb.forget("a")  # Ray restarted it: a new process
        hb.check(30.0)
        hb.check(30.5)
        assert silent == []
        hb.check(31.2)
        assert len(silent) == 1 and "silent for 1.2 s" in silent[0]
        await hb.close()

    _run(scenario)


def test_off_when_suspect_after_is_zero():
    async def scenario():
        hb = Heartbeats(lambda: [], lambda wid: True, lambda wid: 0.0, lambda s, w: None,
                        0.25, 0.0)
        hb.start()
        assert hb._task is None
        await hb.close()

    _run(scenario)


def test_a_call_waiting_on_a_worker_declared_silent_ends_at_once_and_blames_it():
    """A prefill call whose KV goes to a decode worker that then goes silent: the call ends
    when the worker is declared silent, not at its deadline, and the retry avoids the decode
    worker only (the prefill worker did nothing wrong)."""
    import time

    import pytest

    from router.control.request_state import RetryElsewhere, StreamState
    from router.control.worker_calls import WorkerCalls
    from router.control.worker_health import WorkerHealth

    async def scenario():
        lost: list[str] = []
        health = WorkerHealth(None, 30.0, 5.0, lambda wid, why, reason: lost.append(reason))
        calls = WorkerCalls(health, 10.0)
        prefill, decode = _slot("prefill-0"), _slot("decode-0")
        stream = StreamState("r1")
        never = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, health.silent, decode, "gone quiet")
        t0 = time.monotonic()
        with pytest.raises(RetryElsewhere) as info:
            await calls.call(stream, prefill, never, 60.0, peer=decode)
        assert time.monotonic() - t0 < 5.0  # not the call's 60 s deadline
        assert [s.info.worker_id for s in info.value.exclude] == ["decode-0"]
        assert prefill.view.reachable and not decode.view.reachable
        assert lost == ["worker_silent"]
        assert health._waiting == {}  # nothing left registered

    _run(scenario)
