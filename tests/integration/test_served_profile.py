"""`pdcluster profile --served` (router/planning/served_profile.py) on a tiny model: a real
local 1P+1D cluster serves the grid; every prompt length and decode batch gets a positive
time from the workers' own counters, the first token's fixed cost and the steps' slowdown
side by side are measured, the JSON
reads back equal, and the simulator takes that cost instead of its default."""

from __future__ import annotations

import math

import pytest

from engine.tuning.profile import EngineProfile, ProfileGrid
from router.planning.served_profile import profile_served
from router.planning.simulator import ClusterShape, simulate
from router.planning.workload import TraceRequest

pytestmark = pytest.mark.slow


def test_a_served_profile_of_a_tiny_model(tiny_llama_dir):
    grid = ProfileGrid(prompt_lens=(16, 64), prefill_batches=(1,), decode_batches=(1, 4),
                       contexts=(32,), repeats=2, decode_steps=6)
    prof = profile_served(str(tiny_llama_dir), 1, grid)
    # A part of first tokens the profile waited for: within its own run, not a size.
    assert prof.served and prof.overhead_s is not None and 0 <= prof.overhead_s < prof.wall_s
    assert [(b, n) for b, n, _ in prof.prefill] == [(1, 16), (1, 64)]
    # Each grid batch, timed at exactly that many sequences.
    assert [(b, c) for b, c, _ in prof.decode] == [(1, 32), (4, 32)]
    assert all(s > 0 for *_, s in prof.prefill + prof.decode)
    # The steps side by side were measured, not taken as the neutral 1.0 (a tiny model's
    # steps are ~ms on a shared host: only presence and sanity are asserted, not a size).
    for ratio in (prof.prefill_beside_decode, prof.decode_beside_prefill):
        assert math.isfinite(ratio) and ratio > 0 and ratio != 1.0
    assert math.isfinite(prof.busy_overhead_steps) and prof.busy_overhead_steps >= 0
    assert EngineProfile.from_json(prof.to_json()) == prof
    # The simulator's first token comes the measured overhead after the prefill's compute.
    r = simulate(prof, ClusterShape(1, 1, kv_tokens=10**6), [TraceRequest(0, 64, 1)], 9, 9)
    assert r.ttft_s[0] == pytest.approx(prof.prefill_s(64) + prof.overhead_s, rel=1e-6)
