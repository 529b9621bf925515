"""Starting a local Ray (no cluster address) that survives a slow start.

``ray.init()`` without an address starts a GCS and a raylet, and waits a fixed 30 s twice: for
the GCS to publish its port (a ``RuntimeError``, "Timed out waiting for file
.../gcs_server_port_...") and for the raylet to register with the GCS (a bare ``Exception``,
"... timed out during startup"). On a loaded small host (a 2-core CI box in the middle of a
test suite) either wait runs out now and then while the half-started node's processes keep
running: one transient stall would then fail ``pdcluster serve`` or a benchmark outright.
:func:`start_local_ray` ends that node's processes (the pids Ray itself recorded for them) and
starts again; any other error is raised at once.

The one owner of local ``ray.init`` calls: the router's embedded cluster, the benchmarks'
shared Ray session and the tests' Ray fixtures all start Ray here.
"""

from __future__ import annotations

import logging
import types
from typing import Any

log = logging.getLogger(__name__)

# Ray's words when one of its start-up waits runs out (ray/_private/node.py): the raylet's
# registration, the GCS's port file. The only errors retried.
STARTUP_TIMEOUT_TEXT = "timed out during startup"
GCS_PORT_TIMEOUT_TEXT = "gcs_server_port"
STARTUP_TIMEOUT_TEXTS = (STARTUP_TIMEOUT_TEXT, GCS_PORT_TIMEOUT_TEXT)
DEFAULT_ATTEMPTS = 3


def start_local_ray(attempts: int = DEFAULT_ATTEMPTS, **init_kw: Any) -> Any:
    """``ray.init(**init_kw)`` that retries Ray's start-up timeout up to ``attempts`` times in
    all; returns what ``ray.init`` returns. Before each retry the half-started node's processes
    are killed and Ray's driver state is reset, so nothing of the failed try is left running.
    The caller owns the started Ray (``ray.shutdown()``) exactly as after ``ray.init``."""
    import ray

    # Ray renices its worker processes to 15 by default, so that its own daemons win the CPU;
    # our workers are the latency-critical work, and at nice 15 any nice-0 neighbour takes
    # ~97% of a shared core from them (docs/deployment.md, "Beside a neighbour").
    init_kw["_system_config"] = {"worker_niceness": 0, **init_kw.get("_system_config", {})}
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    for attempt in range(1, attempts + 1):
        try:
            return ray.init(**init_kw)
        except Exception as e:
            timed_out = any(text in str(e) for text in STARTUP_TIMEOUT_TEXTS)
            if not timed_out or attempt == attempts:
                raise
            stopped = stop_half_started_node(e.__traceback__)
            ray.shutdown()
            log.warning("local Ray did not start in time (attempt %d of %d: %s); stopped its %d "
                        "processes, starting again", attempt, attempts, e, stopped)
    raise AssertionError("unreachable")  # the loop returns or raises


def stop_half_started_node(tb: types.TracebackType | None) -> int:
    """Kill the processes of the Ray ``Node`` whose constructor raised ``tb`` (found in the
    traceback's frames); returns how many processes that node had recorded (0 when the
    traceback holds no node). Safe on processes that already exited."""
    from ray._private.node import Node

    node = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, Node):
            node = candidate  # the innermost Node frame is the one that raised
        tb = tb.tb_next
    if node is None:
        return 0
    count = sum(len(procs) for procs in getattr(node, "all_processes", {}).values())
    # Not graceful: the node never came up, so there is nothing to drain; wait so the next
    # attempt does not start beside processes still exiting.
    node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
    return count
