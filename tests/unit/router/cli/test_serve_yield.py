"""`pdcluster serve --yield-step-prefill-tokens`: the prompt tokens a step computes of the
priorities below one queued lately (engine/core/prompt_budget.py), on every engine; 0 turns
it off (docs/deployment.md, "Priorities under load")."""

from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from router.cli.main import build_parser
from router.cli.serve_config import serve_config_from_args


def _engines(*argv):
    cc = serve_config_from_args(build_parser().parse_args(["serve", *argv])).cluster_config()
    return cc.prefill_engine, cc.decode_engine


def test_the_default_is_the_engines_and_reaches_every_engine():
    assert {e.yield_step_prefill_tokens for e in _engines()} == {
        SchedulerConfig().yield_step_prefill_tokens}
    assert {e.yield_step_prefill_tokens for e in _engines(
        "--mode", "colocated", "--yield-step-prefill-tokens", "128")} == {128}


def test_zero_turns_it_off_and_a_negative_one_is_named():
    assert {e.yield_step_prefill_tokens for e in _engines(
        "--yield-step-prefill-tokens", "0")} == {None}
    with pytest.raises(ValueError, match="--yield-step-prefill-tokens must be >= 0, got -1"):
        _engines("--yield-step-prefill-tokens", "-1")
