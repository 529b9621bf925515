"""router.control.chooser.WorkerChooser.reprefill_on_decode: where a migrated stream is
computed again in disaggregated mode. "auto" keeps it on a prefill worker only while one is
idle and routable; the fixed policies ignore load; a bad name is refused at configuration.
(The Ray path, both places, tokens equal to an undisturbed run:
tests/integration/test_disaggregation.py.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from router.control.chooser import WorkerChooser
from router.control.config import OrchestratorConfig
from router.routing.policy import WorkerView


@dataclass
class _Slot:
    view: WorkerView


def _prefill(busy: dict[str, int]) -> dict[str, _Slot]:
    slots = {}
    for wid, tokens in busy.items():
        view = WorkerView(wid, "prefill", 64, 16)
        view.inflight_prefill_tokens = tokens
        slots[wid] = _Slot(view)
    return slots


def test_auto_uses_an_idle_prefill_worker_and_the_decode_worker_when_none_is_idle():
    choose = WorkerChooser.reprefill_on_decode
    assert not choose(_prefill({"p0": 512, "p1": 0}), "auto")  # p1 is idle
    assert choose(_prefill({"p0": 512, "p1": 64}), "auto")  # both computing new prompts
    slots = _prefill({"p0": 512, "p1": 0})
    slots["p1"].view.reachable = False  # idle, but no new work goes there
    assert choose(slots, "auto")
    slots["p1"].view.reachable, slots["p1"].view.draining = True, True
    assert choose(slots, "auto")
    assert choose({}, "auto")  # no prefill worker at all


def test_fixed_policies_ignore_load():
    choose = WorkerChooser.reprefill_on_decode
    assert choose(_prefill({"p0": 0}), "decode")
    assert not choose(_prefill({"p0": 512}), "prefill")


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="migration_prefill must be one of auto, prefill, decode"):
        OrchestratorConfig("m", migration_prefill="local")
