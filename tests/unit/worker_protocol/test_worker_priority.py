"""A worker started at a lower priority than the process that started it (Ray renices its
workers to 15 by default) takes that process's priority back, on every thread, where the OS
lets it (root here, as in CI); where it does not, it says so and runs as started."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = """
import logging, os, sys, threading
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
before = threading.Thread(target=threading.Event().wait, daemon=True)
before.start()  # a thread started before the call, at the lower priority
from worker_protocol.runtime import restore_priority
got = restore_priority()
nices = {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}
print("RESULT", got, sorted(nices))
"""


def _run_child(*prefix: str) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-c", CHILD], capture_output=True,
                          text=True, timeout=60, check=True)


def test_a_reniced_worker_takes_its_parents_priority_back_on_every_thread():
    here = os.getpriority(os.PRIO_PROCESS, 0)
    if here > 4:
        pytest.fail(f"this test process already runs at nice {here}: run the suite at < 5")
    out = _run_child("nice", "-n", "15")
    # `nice` execs Python, so the child's parent is this process: its priority is the target.
    result = next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))
    if os.geteuid() == 0:  # lowering a nice value needs CAP_SYS_NICE
        assert result == f"RESULT {here} [{here}]", out.stderr
        assert f"nice {here + 15} -> {here}" in out.stderr
    else:
        assert result == f"RESULT {here + 15} [{here + 15}]", out.stderr
        assert "RAY_worker_niceness=0" in out.stderr


def test_a_worker_at_its_parents_priority_is_left_alone():
    out = _run_child()
    here = os.getpriority(os.PRIO_PROCESS, 0)
    assert f"RESULT {here} [{here}]" in out.stdout
    assert "restored" not in out.stderr
