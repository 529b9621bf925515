"""router.control.heartbeat: a decode worker is declared silent only when both signals agree
(no heartbeat answered and no token batch for ``suspect_after_s`` while it holds streams),
once, and re-armed when it answers again; any worker late to answer is looked up in Ray's
actor table, and one Ray calls RESTARTING or DEAD is declared gone at once. Pings are driven
by a stand-in actor handle whose answers the test releases, the table by a dict (the Ray
path: tests/integration/test_disaggregation.py, SIGKILL and SIGSTOP)."""

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
    role: str = "decode"
    incarnation: str = "first"


@dataclass
class _Slot:
    info: _Info
    handle: _Handle
    view: WorkerView


def _slot(wid: str, role: str = "decode") -> _Slot:
    return _Slot(_Info(wid, role), _Handle(), WorkerView(wid, role, 64, 16))


def _no_gone(slot, state, why) -> None:
    raise AssertionError(f"{slot.info.worker_id} declared gone: {why}")


def _alive(handle) -> str:
    return "ALIVE"


def _run(scenario) -> None:
    asyncio.run(scenario())


def test_silent_only_when_no_pong_and_no_tokens_while_holding_streams():
    async def scenario():
        stopped, busy, idle, fine = (_slot(w) for w in ("stopped", "busy", "idle", "fine"))
        tokens = {"busy": 0.0}
        silent: list[str] = []
        hb = Heartbeats(lambda: [stopped, busy, idle, fine], lambda wid: wid != "idle",
                        lambda wid: tokens.get(wid, 0.0),
                        lambda slot, why: silent.append(slot.info.worker_id), _no_gone, 0.25,
                        1.0, _alive)
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


def test_a_check_after_a_stalled_loop_judges_no_silence_until_the_answers_are_read():
    """The loop stalled 3 s: the pong that came meanwhile is not read yet when the late check
    runs, which declares nobody silent; the pong is read before the next check, and a worker
    that answered is never moved. One that did not answer is moved at the next check."""
    async def scenario():
        up, down = _slot("up"), _slot("down")
        silent: list[str] = []
        hb = Heartbeats(lambda: [up, down], lambda wid: True, lambda wid: 0.0,
                        lambda slot, why: silent.append(slot.info.worker_id), _no_gone, 0.25,
                        1.0, _alive)
        hb.check(10.0)
        up.handle.answer()  # answered during the stall; its callback has not run yet
        hb.check(13.0)  # the late check
        assert silent == []
        await asyncio.sleep(0)  # the loop reads the pong
        hb.check(13.25)
        assert silent == ["down"]
        await hb.close()

    _run(scenario)


def test_dead_or_drained_workers_are_not_watched_and_a_restarted_one_starts_afresh():
    async def scenario():
        a = _slot("a")
        silent: list[str] = []
        hb = Heartbeats(lambda: [a], lambda wid: True, lambda wid: 0.0,
                        lambda slot, why: silent.append(why), _no_gone, 0.25, 1.0, _alive)
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
                        _no_gone, 0.25, 0.0, _alive)
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


async def _settle() -> None:
    """Let the actor-table questions (a thread each) come back to the loop."""
    for _ in range(50):
        await asyncio.sleep(0.01)


def test_a_worker_late_to_answer_is_looked_up_and_declared_gone_only_on_rays_word():
    """Half a second without a pong asks Ray's table (once per question); RESTARTING or DEAD
    declares the worker gone at once, whatever its kind, long before the silence rule's
    second; ALIVE or an unreadable table changes nothing."""
    async def scenario():
        killed, stopped, unknown = _slot("killed"), _slot("stopped"), _slot("unknown")
        dead_prefill = _slot("prefill-0", "prefill")
        states = {"killed": "RESTARTING", "stopped": "ALIVE", "unknown": None,
                  "prefill-0": "DEAD"}
        asked: list[str] = []

        def table(handle) -> str | None:
            wid = next(s.info.worker_id for s in slots if s.handle is handle)
            asked.append(wid)
            return states[wid]

        slots = [killed, stopped, unknown, dead_prefill]
        gone: list[tuple[str, str]] = []
        silent: list[str] = []
        hb = Heartbeats(lambda: slots, lambda wid: True, lambda wid: 0.0,
                        lambda slot, why: silent.append(slot.info.worker_id),
                        lambda slot, state, why: gone.append((slot.info.worker_id, state)),
                        0.25, 1.0, table)
        hb.check(100.0)
        hb.check(100.25)
        await _settle()
        assert asked == [] and gone == []  # not late yet
        hb.check(100.6)
        await _settle()
        assert sorted(asked) == ["killed", "prefill-0", "stopped", "unknown"]
        assert sorted(gone) == [("killed", "RESTARTING"), ("prefill-0", "DEAD")]
        assert hb.num_gone == 2 and silent == []
        hb.check(100.9)
        await _settle()
        assert len(gone) == 2  # declared once; the others asked again, still alive
        hb.check(101.2)
        await _settle()
        # the silence rule: decode workers only, not those already declared gone
        assert silent == ["stopped", "unknown"]
        await hb.close()

    _run(scenario)


def test_an_answer_about_a_replaced_process_is_ignored():
    async def scenario():
        a = _slot("a")
        gone: list[str] = []

        def table(handle) -> str:
            a.info.incarnation = "second"  # Ray restarted it while the question was out
            return "RESTARTING"

        hb = Heartbeats(lambda: [a], lambda wid: False, lambda wid: 0.0, lambda s, w: None,
                        lambda slot, state, why: gone.append(state), 0.25, 1.0, table)
        hb.check(10.0)
        hb.check(10.6)
        await _settle()
        assert gone == []
        await hb.close()

    _run(scenario)


def test_a_prefill_call_on_a_worker_declared_gone_ends_at_once_and_spares_its_peer():
    """A prefill worker killed mid-call: Ray's table says so, the call ends then (not at its
    deadline), and the retry excludes the prefill worker only, not the decode worker its KV
    was going to."""
    import time

    import pytest

    from router.control.request_state import RetryElsewhere, StreamState
    from router.control.worker_calls import WorkerCalls
    from router.control.worker_health import WorkerHealth

    async def scenario():
        lost: list[str] = []
        health = WorkerHealth(None, 30.0, 5.0, lambda wid, why, reason: lost.append(reason))
        calls = WorkerCalls(health, 10.0)
        prefill, decode = _slot("prefill-0", "prefill"), _slot("decode-0")
        stream = StreamState("r1")
        never = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, health.gone, prefill, "RESTARTING", "gone")
        t0 = time.monotonic()
        with pytest.raises(RetryElsewhere) as info:
            await calls.call(stream, prefill, never, 60.0, peer=decode)
        assert time.monotonic() - t0 < 5.0
        assert [s.info.worker_id for s in info.value.exclude] == ["prefill-0"]
        assert "lost during the call" in str(info.value.error)
        assert decode.view.reachable and not prefill.view.reachable and prefill.view.alive
        assert lost == []  # a prefill worker holds no streams
        health.gone(decode, "DEAD", "gone for good")
        assert not decode.view.alive and lost == ["worker_died"]
        assert health._waiting == {}

    _run(scenario)
