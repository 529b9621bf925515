"""The shared local Ray's isolation check (tests/helpers/shared_ray.py): an actor a module
leaves alive is found and named; one that was ended is not."""

from __future__ import annotations

import pytest

from tests.helpers.shared_ray import assert_no_live_actors


def test_a_live_actor_is_named_and_an_ended_one_is_not(shared_ray_loop):
    import ray

    class _Probe:  # defined here: Ray ships it by value (the test module is not importable there)
        def ping(self) -> int:
            return 1

    probe = ray.remote(num_cpus=0)(_Probe).options(name="leak-probe").remote()
    assert ray.get(probe.ping.remote(), timeout=60) == 1
    with pytest.raises(AssertionError, match=r"leak-probe \(.*_Probe\)"):
        assert_no_live_actors(timeout_s=0.5)
    ray.kill(probe)
    assert_no_live_actors()
