"""router/cluster/local_ray.py: a local Ray start that times out is retried, and the half-started
node's processes are stopped first. Ray's start-up wait is a fixed 30 s, so the timeout itself
is raised here by a stand-in for ``ray.init``'s first call; the node that is stopped is a real
one, started by the real ``ray.init``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from router.cluster.local_ray import (
    GCS_PORT_TIMEOUT_TEXT,
    STARTUP_TIMEOUT_TEXT,
    start_local_ray,
    stop_half_started_node,
)

ROOT = Path(__file__).resolve().parents[4]
# Ray's exact words (ray/_private/node.py), as a CI run met them.
RAY_TIMEOUT = ("The current node timed out during startup. This could happen because some of "
               "the raylet failed to startup or the GCS has become overloaded.")


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone: it has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# The other wait (a CI run met it too): the GCS's port file, a RuntimeError.
RAY_GCS_PORT_TIMEOUT = ("Timed out waiting for file /tmp/ray/session_2026-12-06_15-26-36_241362_"
                        "29806/gcs_server_port_9d35ec5456582c6e6b46acf6659797fe79936d058a9d53840"
                        "a110c98")


def test_the_timeout_texts_are_rays_own():
    assert STARTUP_TIMEOUT_TEXT in RAY_TIMEOUT
    assert GCS_PORT_TIMEOUT_TEXT in RAY_GCS_PORT_TIMEOUT


@pytest.mark.parametrize("error", [Exception(RAY_TIMEOUT), RuntimeError(RAY_GCS_PORT_TIMEOUT)],
                         ids=["raylet-registration", "gcs-port"])
def test_either_start_up_wait_running_out_is_retried(monkeypatch, error):
    import ray

    calls = []

    def init_that_always_times_out(**kw):
        calls.append(kw)
        raise error

    monkeypatch.setattr(ray, "init", init_that_always_times_out)
    with pytest.raises(type(error)) as raised:
        start_local_ray(attempts=3, num_cpus=1)
    assert raised.value is error  # the last attempt's own error, not a wrapper
    assert len(calls) == 3
    assert not ray.is_initialized()


def test_a_timed_out_start_is_retried_and_the_half_started_node_is_stopped(monkeypatch, caplog):
    import ray
    from ray._private import worker

    real_init = ray.init
    calls = []

    def init_that_times_out_once(**kw):
        calls.append(kw)
        if len(calls) == 1:
            raise Exception(RAY_TIMEOUT)
        return real_init(**kw)

    monkeypatch.setattr(ray, "init", init_that_times_out_once)
    with caplog.at_level(logging.WARNING, logger="router.cluster.local_ray"):
        start_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        assert ray.is_initialized()
        assert len(calls) == 2 and calls[0] == calls[1]
        assert "attempt 1 of 3" in caplog.text
        # Its workers run at this process's priority, not Ray's default niceness of 15.
        assert calls[0]["_system_config"]["worker_niceness"] == 0

        @ray.remote
        def nice_of_every_thread():
            import os

            return {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}

        assert ray.get(nice_of_every_thread.remote(), timeout=60) == {
            os.getpriority(os.PRIO_PROCESS, 0)}

        # A node whose constructor raised: its processes (real ones) are killed by their pids.
        node = worker._global_node
        pids = [p.process.pid for procs in node.all_processes.values() for p in procs]
        assert pids and all(_alive(pid) for pid in pids)

        def node_constructor(self):  # the frame shape of ray's Node.__init__
            raise Exception(RAY_TIMEOUT)

        with pytest.raises(Exception, match=STARTUP_TIMEOUT_TEXT) as raised:
            node_constructor(node)
        assert type(raised.value) is Exception  # Ray's own type for it: a bare Exception
        assert stop_half_started_node(raised.value.__traceback__) == len(pids)
        assert not any(_alive(pid) for pid in pids)
    finally:
        ray.shutdown()


def test_other_errors_and_the_last_attempt_are_raised_at_once(monkeypatch):
    import ray

    calls = []
    error = ["some other start-up error"]

    def failing_init(**kw):
        calls.append(kw)
        raise Exception(error[0])

    monkeypatch.setattr(ray, "init", failing_init)
    # Ray raises a bare Exception (not a subclass): the very error is raised, not wrapped.
    with pytest.raises(Exception, match="some other start-up error") as raised:
        start_local_ray(num_cpus=1)
    assert type(raised.value) is Exception
    assert len(calls) == 1  # not retried

    calls.clear()
    error[0] = RAY_TIMEOUT
    with pytest.raises(Exception, match="timed out during startup") as raised:
        start_local_ray(attempts=2, num_cpus=1)
    assert type(raised.value) is Exception
    assert len(calls) == 2  # retried once, then the last attempt's error
    assert not ray.is_initialized()
    assert stop_half_started_node(None) == 0


def test_only_local_ray_starts_a_local_ray():
    """Every ``ray.init`` without a cluster address goes through start_local_ray."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in (".venv", "build") or rel == Path("router/cluster/local_ray.py"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if "ray.init(" in code and "address=" not in code and "``" not in code:
                offenders.append(f"{rel}:{n}")
    assert offenders == []
