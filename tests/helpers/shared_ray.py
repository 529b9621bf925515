"""One local Ray per pytest process for the integration modules that only need *a* Ray.

Starting and stopping a local Ray costs ~5-7 s on a 2-core host, and fourteen modules each
started their own for clusters they start and shut down themselves. They now share one
(``tests/integration/conftest.py``: the ``shared_ray_loop`` fixture), started on first use with
``SHARED_RAY_INIT`` (room for every such module's cluster shapes) and stopped when the process
ends, or before a module that starts a Ray of its own (the bench modules, the placement and
namespace tests, `Cluster.start` without a Ray, ``ray_loop``): ``tests/conftest.py`` stops it
before any module that does not ask for it.

What sharing must not cost is isolation: a module that leaves an actor alive would hand it to
the next one. ``assert_no_live_actors`` runs at the end of every sharing module and fails it,
naming the actors, if any outlived its clusters.
"""

from __future__ import annotations

import time

SHARED_RAY_INIT = {"num_cpus": 16, "resources": {"prefill_slot": 8, "decode_slot": 8}}

_up = False  # this process started the shared Ray and has not stopped it


def ensure_shared_ray() -> None:
    """Start the shared Ray unless it is up. A Ray this process started otherwise (not shared)
    is an error: its owner must have shut it down."""
    global _up
    import ray

    from router.cluster.local_ray import start_local_ray

    if _up:
        return
    assert not ray.is_initialized(), "a Ray that is not the shared one is still up"
    start_local_ray(include_dashboard=False, log_to_driver=False, **SHARED_RAY_INIT)
    _up = True


def shared_ray_up() -> bool:
    return _up


def stop_shared_ray() -> None:
    """Shut the shared Ray down if it is up (a no-op otherwise)."""
    global _up
    import ray

    if _up:
        _up = False
        ray.shutdown()


def assert_no_live_actors(timeout_s: float = 30.0) -> None:
    """Wait until no actor of the shared Ray is alive (a cluster's shutdown ends its workers
    asynchronously); fail after ``timeout_s`` naming the ones still alive."""
    from ray._private import state

    deadline = time.monotonic() + timeout_s
    while True:
        alive = [f"{a.get('Name') or a['ActorID']} ({a['ActorClassName']})"
                 for a in state.actors().values() if a["State"] != "DEAD"]
        if not alive:
            return
        assert time.monotonic() < deadline, (
            f"actors still alive {timeout_s} s after the module's clusters shut down: {alive}")
        time.sleep(0.1)
