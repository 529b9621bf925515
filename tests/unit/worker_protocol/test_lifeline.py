"""worker_protocol.lifeline and the router's side of it (router.control.heartbeat): a killed
process's lifeline reads EOF at once, a stopped one's stays open (no false alarm), and the
router declares a worker gone ("EXITED") only for the process it connected to, while it is
routed to. The Ray path (a SIGKILLed decode worker's streams moving on the lifeline's word):
tests/integration/test_disaggregation.py."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import socket
import time
from dataclasses import dataclass, field

import pytest

from router.control.heartbeat import Heartbeats
from router.routing.policy import WorkerView
from worker_protocol.lifeline import Lifeline


def _connect(port: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    conn.settimeout(0.3)
    return conn


def _closed(conn: socket.socket) -> bool:
    """EOF (or a reset) on ``conn`` within its timeout; False if it stays open."""
    try:
        return conn.recv(16) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_connections_stay_open_until_close_and_bytes_are_discarded():
    line = Lifeline("127.0.0.1", "w0")
    a, b = _connect(line.port), _connect(line.port)
    a.sendall(b"anything")  # read and dropped; nothing comes back
    assert not _closed(a) and not _closed(b)
    deadline = time.monotonic() + 5
    while line.num_connections < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert line.num_connections == 2
    b.close()  # a router leaving: its connection ends here, the other stays
    while line.num_connections > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert line.num_connections == 1 and not _closed(a)
    line.close()
    a.settimeout(5.0)
    assert _closed(a)
    with pytest.raises(OSError):  # the listener is gone too
        socket.create_connection(("127.0.0.1", line.port), timeout=2.0)
    a.close()


def test_a_listener_that_fails_keeps_its_connections_open_until_close():
    """A bug in the listener thread must not read, to a router, as the process's death: its
    connections stay open (and one made afterwards too) until ``close``, which still works."""
    line = Lifeline("127.0.0.1", "w0")
    a = _connect(line.port)
    deadline = time.monotonic() + 5
    while line.num_connections < 1 and time.monotonic() < deadline:
        time.sleep(0.01)

    def broken(conn):
        raise RuntimeError("a bug")

    line._drain = broken  # the next bytes that arrive kill the listener thread
    a.sendall(b"x")
    line._thread.join(timeout=5.0)
    assert not line._thread.is_alive()
    late = _connect(line.port)  # lands in the listen backlog
    assert not _closed(a) and not _closed(late)
    line.close()
    a.settimeout(5.0)
    late.settimeout(5.0)
    assert _closed(a) and _closed(late)
    a.close()
    late.close()


def test_connections_past_the_cap_are_closed_at_once():
    line = Lifeline("127.0.0.1", "w0", max_connections=2)
    kept = [_connect(line.port), _connect(line.port)]
    deadline = time.monotonic() + 5
    while line.num_connections < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    extra = _connect(line.port)
    extra.settimeout(5.0)
    assert _closed(extra)
    assert not any(_closed(c) for c in kept)
    line.close()
    for c in [*kept, extra]:
        c.close()


def _hold_lifeline(ports) -> None:
    line = Lifeline("127.0.0.1", "child")
    ports.put(line.port)
    time.sleep(120)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_a_killed_process_closes_its_lifeline_a_stopped_one_does_not(sig):
    ports = mp.get_context("spawn").Queue()
    child = mp.get_context("spawn").Process(target=_hold_lifeline, args=(ports,), daemon=True)
    child.start()
    try:
        conn = _connect(ports.get(timeout=60))
        assert not _closed(conn)
        os.kill(child.pid, getattr(signal, sig))
        conn.settimeout(5.0 if sig == "SIGKILL" else 1.0)
        assert _closed(conn) == (sig == "SIGKILL")
        conn.close()
    finally:
        if sig == "SIGSTOP":
            os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.join(10)


@dataclass
class _Info:
    worker_id: str
    lifeline_port: int
    role: str = "decode"
    incarnation: str = "first"
    node_ip: str = "127.0.0.1"


@dataclass
class _Slot:
    info: _Info
    view: WorkerView
    handle: object = field(default=None)


def _heartbeats(slots, gone, suspect_after_s=1.0, ray_state=lambda handle: "RESTARTING"
                ) -> Heartbeats:
    # A long interval: only the lifeline can declare anything within these tests.
    return Heartbeats(lambda: [], lambda wid: True, lambda wid: 0.0,
                      lambda slot, why: None,
                      lambda slot, state, why: gone.append((slot.info.worker_id, state, why)),
                      3600.0, suspect_after_s, ray_state)


async def _wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_the_router_declares_a_worker_exited_when_its_lifeline_closes():
    async def scenario():
        lines = {w: Lifeline("127.0.0.1", w) for w in ("d0", "p0", "drained", "old")}
        slots = {w: _Slot(_Info(w, line.port, "prefill" if w == "p0" else "decode"),
                          WorkerView(w, "decode", 64, 16)) for w, line in lines.items()}
        gone: list = []
        hb = _heartbeats(slots, gone)
        for slot in slots.values():
            hb.watch(slot)
        await _wait_for(lambda: all(x.num_connections == 1 for x in lines.values()))
        assert all(x.num_connections == 1 for x in lines.values())
        slots["drained"].view.drained = True  # retired on purpose: its exit is news to no one
        slots["old"].info.incarnation = "second"  # replaced meanwhile (a rejoin not yet seen)
        for line in lines.values():
            line.close()
        await _wait_for(lambda: len(gone) >= 2)
        await asyncio.sleep(0.2)  # time for a wrong third report to show
        assert sorted((w, s) for w, s, _ in gone) == [("d0", "EXITED"), ("p0", "EXITED")]
        assert "lifeline at 127.0.0.1:" in gone[0][2] and hb.num_exited == 2
        await hb.close()

    asyncio.run(scenario())


def test_a_rejoined_worker_is_held_by_its_new_lifeline_and_closing_the_router_reports_nothing():
    async def scenario():
        first, second = Lifeline("127.0.0.1", "d0"), Lifeline("127.0.0.1", "d0")
        slot = _Slot(_Info("d0", first.port), WorkerView("d0", "decode", 64, 16))
        gone: list = []
        hb = _heartbeats([slot], gone)
        hb.watch(slot)
        await _wait_for(lambda: first.num_connections == 1)
        slot.info = _Info("d0", second.port, incarnation="second")  # Ray restarted it
        hb.watch(slot)
        await _wait_for(lambda: second.num_connections == 1 and first.num_connections == 0)
        assert (first.num_connections, second.num_connections) == (0, 1)
        first.close()
        await asyncio.sleep(0.2)
        assert gone == []
        await hb.close()  # the router's own end: its connection closes, nothing is declared
        await _wait_for(lambda: second.num_connections == 0)
        assert second.num_connections == 0 and gone == []
        second.close()

    asyncio.run(scenario())


def test_no_lifeline_is_held_with_heartbeats_off_or_when_none_is_reachable():
    async def scenario():
        line = Lifeline("127.0.0.1", "d0")
        off: list = []
        hb = _heartbeats([], off, suspect_after_s=0.0)
        hb.watch(_Slot(_Info("d0", line.port), WorkerView("d0", "decode", 64, 16)))
        await asyncio.sleep(0.2)
        assert line.num_connections == 0
        await hb.close()
        line.close()
        # A port nothing listens on (the lifeline just closed): a warning, no report.
        hb = _heartbeats([], off)
        hb.watch(_Slot(_Info("d0", line.port), WorkerView("d0", "decode", 64, 16)))
        await asyncio.sleep(0.3)
        assert off == [] and hb.num_exited == 0
        await hb.close()

    asyncio.run(scenario())


def test_an_exited_worker_ray_calls_dead_is_declared_dead_after_its_exit():
    """EOF first (EXITED: streams move at once), then Ray's table decides what comes next:
    DEAD (no restart left) is reported too, so the worker is never routed to again;
    RESTARTING (above) is left to the rejoin. The table is asked until it flips."""
    async def scenario():
        line = Lifeline("127.0.0.1", "d0")
        slot = _Slot(_Info("d0", line.port), WorkerView("d0", "decode", 64, 16))
        answers = iter(["ALIVE", "ALIVE", "DEAD"])  # Ray has not noticed yet, then has
        gone: list = []
        hb = _heartbeats([slot], gone, ray_state=lambda handle: next(answers))
        hb.watch(slot)
        await _wait_for(lambda: line.num_connections == 1)
        line.close()
        await _wait_for(lambda: len(gone) == 2)
        assert [(w, s) for w, s, _ in gone] == [("d0", "EXITED"), ("d0", "DEAD")]
        await hb.close()

    asyncio.run(scenario())
