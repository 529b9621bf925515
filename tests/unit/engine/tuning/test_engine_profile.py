"""`pdcluster profile` (engine/tuning/profile.py): a tiny grid measured on a tiny model gives every
point, positive and ordered the way compute is (more tokens, more time); the JSON reads back
equal; interpolation goes through the measured points and along the end segments; the
loopback bandwidth (router/planning/loopback.py) is measured, not assumed; the command writes
the file, loopback included."""

from __future__ import annotations

import json

import pytest

from engine import EngineArgs
from engine.tuning.profile import EngineProfile, ProfileGrid, profile_engine
from router.planning.loopback import measure_loopback_bytes_s


def test_a_tiny_grid_on_a_tiny_model(tiny_llama_dir):
    grid = ProfileGrid(prompt_lens=(16, 128), prefill_batches=(1, 2), decode_batches=(1, 4),
                       contexts=(16, 64), repeats=2, decode_steps=3)
    prof = profile_engine(EngineArgs(model=str(tiny_llama_dir), num_threads=1), grid)
    assert [(b, n) for b, n, _ in prof.prefill] == [(1, 16), (2, 16), (1, 128), (2, 128)]
    assert [(b, c) for b, c, _ in prof.decode] == [(1, 16), (4, 16), (1, 64), (4, 64)]
    assert all(s > 0 for *_, s in prof.prefill + prof.decode)
    assert prof.loopback_bytes_s == 0.0  # the planner measures it (router.planning.loopback)
    assert prof.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers, kv heads, head dim, fp32
    assert EngineProfile.from_json(prof.to_json()) == prof


def _profile() -> EngineProfile:
    return EngineProfile("m", 1, "cpu", 2048, 100,
                         prefill=[(1, 100, 1.0), (2, 100, 2.2), (1, 300, 3.0)],
                         decode=[(1, 100, 0.01), (8, 100, 0.03), (1, 500, 0.02), (8, 500, 0.06)])


def test_interpolation_passes_through_points_and_extends_the_end_segments():
    p = _profile()
    assert p.prefill_s(100) == pytest.approx(1.0)
    # One prompt's points where the profile has them (2 x 100 tokens, 2.2 s, is not one).
    assert p.prefill_s(200) == pytest.approx(2.0)
    assert p.prefill_s(250) == pytest.approx(2.5)
    assert p.prefill_s(400) == pytest.approx(4.0)  # along the last segment
    assert p.prefill_s(50) == pytest.approx(0.5)  # and the first
    # A profile of batches only folds them in by tokens.
    batched = EngineProfile("m", 1, "cpu", 2048, 100, prefill=[(2, 50, 1.1), (2, 150, 3.3)])
    assert batched.prefill_s(200) == pytest.approx(2.2)
    assert p.decode_step_s(1, 100) == pytest.approx(0.01)
    assert p.decode_step_s(8, 500) == pytest.approx(0.06)
    assert p.decode_step_s(4.5, 300) == pytest.approx((0.02 + 0.04) / 2)
    assert p.decode_step_s(8, 1000) == pytest.approx(0.06)  # past the last context: its row


def test_loopback_bandwidth_is_measured():
    assert measure_loopback_bytes_s(8 << 20) > 1e6


def test_the_command_writes_the_profile(tiny_llama_dir, tmp_path, monkeypatch):
    from engine.tuning import profile as mod
    from router.cli.main import build_parser

    small = ProfileGrid(prompt_lens=(16,), prefill_batches=(1,), decode_batches=(1,),
                        contexts=(16,), repeats=1, decode_steps=2)
    monkeypatch.setattr(mod.ProfileGrid, "quick", classmethod(lambda cls: small))
    out = tmp_path / "p.json"
    args = build_parser().parse_args(["profile", "--model", str(tiny_llama_dir),
                                      "--out", str(out)])
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    assert data["num_threads"] == 1 and len(data["prefill"]) == len(data["decode"]) == 1
    assert data["loopback_bytes_s"] > 1e6


def test_the_grid_keeps_to_the_model_and_to_a_workers_step():
    g = ProfileGrid.quick()
    assert max(g.prompt_lens) == 2048  # long prompts measured, not extrapolated
    short = g.within(512)
    assert max(short.prompt_lens) <= 512 - g.decode_steps - 2 and max(short.contexts) <= 506
    assert ProfileGrid(prompt_lens=(600,), contexts=(700,)).within(512).prompt_lens == (600,)
    # Several prompts only where they fit one step of the worker's budget.
    pts = ProfileGrid(prompt_lens=(256, 1024), prefill_batches=(1, 4)).prefill_points(2048)
    assert pts == [(1, 256), (4, 256), (1, 1024)]
