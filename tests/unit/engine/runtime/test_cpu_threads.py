"""An engine's thread count end to end: the driver (EngineThreads) with injected fakes, an
engine in a 1-CPU affinity mask running 1 thread, and greedy tokens that are the same at 2
threads, at 1, and when the governor drops 2 -> 1 mid-run."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.runtime.cpu_threads import (
    CpuBudget,
    EngineThreads,
    GovernorConfig,
    Window,
)
from tests.helpers.cpu_fakes import FakeClock, FakeStolen

REPO = Path(__file__).resolve().parents[4]
CFG = GovernorConfig()  # the defaults the tests' numbers are written against



def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _affinity() -> int:
    return len(os.sched_getaffinity(0))


@pytest.fixture
def torch_threads():
    """Tests that build engines set torch's thread count: give the next test the one found."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# ---- the engine's driver --------------------------------------------------------------------

def _driver(max_threads=None, adaptive=True, budget=CpuBudget(2, None)):
    clock, stolen, applied, changed = FakeClock(), FakeStolen(), [], []
    et = EngineThreads(max_threads, adaptive, budget=lambda: budget, stolen=lambda: stolen,
                       set_threads=applied.append, clock=clock)
    et.on_change = changed.append
    return et, clock, stolen, applied, changed


def test_engine_threads_decide_at_each_window_end():
    et, clock, stolen, applied, changed = _driver()
    assert (et.threads, applied, et.budget) == (2, [2], CpuBudget(2, None))
    # Within the window: counted, nothing decided.
    clock.t += 0.125
    et.after_step(0.125, 8)
    assert (stolen.reads, applied, changed) == (0, [2], [])
    # The window ends: both threads lost half their time -> a trial of 1, applied, announced.
    clock.t += 0.125
    stolen.script.append((0.25, 0.25, 0.0))
    et.after_step(0.125, 8)
    assert stolen.reads == 1
    assert (et.threads, applied, changed) == (1, [2, 1], [1])
    assert et.governor.last_stolen == pytest.approx(0.5)
    assert et.governor.probing and et.governor.window_s == CFG.window_s
    # Its window: the same kind of step in 62.5 ms against 125: kept, nothing to apply.
    for _ in range(4):
        clock.t += 0.0625
        et.after_step(0.0625, 8)
    assert stolen.reads == 2 and not et.governor.probing
    assert (et.threads, applied, changed) == (1, [2, 1], [1])
    # Windows before the up back-off: nothing changes.
    for _ in range(7 * 4):
        clock.t += 0.0625
        et.after_step(0.0625, 8)
    assert stolen.reads == 9
    assert (et.threads, applied, changed) == (1, [2, 1], [1])
    # After it: a trial of 2 ...
    for _ in range(4):
        clock.t += 0.0625
        et.after_step(0.0625, 8)
    assert (et.threads, applied, changed) == (2, [2, 1, 2], [1, 2])
    assert et.governor.probing
    # ... whose steps take 125 ms against 62.5 (the neighbour is still there): back to 1.
    for _ in range(2):
        clock.t += 0.125
        et.after_step(0.125, 8)
    assert (et.threads, applied, changed) == (1, [2, 1, 2, 1], [1, 2, 1])
    assert not et.governor.probing


def test_engine_threads_pass_each_steps_kind_into_the_window():
    et, clock, stolen, applied, changed = _driver()
    windows: list[Window] = []
    observe = et.governor.observe

    def spy(w: Window, now: float) -> int:
        windows.append(w)
        return observe(w, now)

    et.governor.observe = spy
    # One window of two kinds of step: decodes of 8 rows and a prefill of 64 tokens; both
    # threads lost half of it: a trial of 1.
    stolen.script.append((0.25, 0.25, 0.0))
    for step_s, kind in ((0.0625, "decode8"), (0.0625, "decode8"), (0.125, ("prefill", 64))):
        clock.t += step_s
        et.after_step(step_s, kind)
    assert windows[0].steps == {"decode8": (2, 0.125), ("prefill", 64): (1, 0.125)}
    assert windows[0].busy_s == 0.25
    assert et.threads == 1 and et.governor.probing
    # Only another kind of step at the trial's count: nothing to compare, the trial waits.
    clock.t += 0.25
    et.after_step(0.25, "decode4")
    assert windows[1].steps == {"decode4": (1, 0.25)}
    assert et.threads == 1 and et.governor.probing
    # The reference's decodes of 8 rows, 31.25 ms a step against 62.5: kept.
    for _ in range(8):
        clock.t += 0.03125
        et.after_step(0.03125, "decode8")
    assert windows[2].steps == {"decode8": (8, 0.25)}
    assert not et.governor.probing and (et.threads, applied, changed) == (1, [2, 1], [1])
    # A step before an idle wait belongs to no window; a step without a kind is of kind None.
    clock.t += 0.125
    et.after_step(0.125, "decode8")
    clock.t += 5.0
    et.idle()
    clock.t += 0.25
    et.after_step(0.25)
    assert windows[3].steps == {None: (1, 0.25)} and len(windows) == 4
    # Each window has its own mapping: later steps never change one the governor holds.
    assert windows[0].steps == {"decode8": (2, 0.125), ("prefill", 64): (1, 0.125)}


def test_engine_threads_idle_time_starts_a_new_window():
    et, clock, stolen, applied, _ = _driver()
    clock.t += 10.0  # waited for work
    et.idle()
    assert stolen.reads == 1
    clock.t += 0.125
    et.after_step(0.125)
    assert stolen.reads == 1  # the window began at the idle() call, 0.125 s ago
    clock.t += 0.125
    et.after_step(0.125)
    assert stolen.reads == 2 and applied == [2]


def test_engine_threads_follow_a_new_budget():
    budgets = [CpuBudget(4, None)]
    clock, stolen, applied = FakeClock(), FakeStolen(), []
    et = EngineThreads(None, True, budget=lambda: budgets[-1], stolen=lambda: stolen,
                       set_threads=applied.append, clock=clock)
    assert applied == [4]
    budgets.append(CpuBudget(4, 2.0))  # a quota arrived
    clock.t += EngineThreads.BUDGET_EVERY_S - 0.25
    et.after_step(EngineThreads.BUDGET_EVERY_S - 0.25)
    assert et.threads == 4  # not read again yet
    clock.t += 0.25
    et.after_step(0.25)
    assert (et.threads, applied, et.budget) == (2, [4, 2], CpuBudget(4, 2.0))


def test_engine_threads_not_adaptive_never_change():
    made = []
    clock, applied = FakeClock(), []
    et = EngineThreads(None, False, budget=lambda: CpuBudget(2, None),
                       stolen=lambda: made.append(1), set_threads=applied.append, clock=clock)
    et.on_change = applied.append
    assert made == []  # no stolen-time reader at all
    for _ in range(20):
        clock.t += 1.0
        et.after_step(1.0)
        et.idle()
    assert (et.threads, applied) == (2, [2])


def test_engine_threads_explicit_count():
    et, clock, stolen, applied, changed = _driver(max_threads=1, budget=CpuBudget(4, None))
    assert (et.threads, et.governor.max_threads, applied) == (1, 1, [1])
    for _ in range(40):  # idle CPUs, quiet windows, budget re-reads: still the operator's 1
        clock.t += 0.5
        stolen.script.append((0.5, 0.0, 3.0))
        et.after_step(0.5)
    assert (et.threads, applied, changed) == (1, [1], [])
    # An explicit count above 1 is the most the governor runs, whatever the budget says.
    et, *_ = _driver(max_threads=3, budget=CpuBudget(1, None))
    assert (et.threads, et.governor.max_threads) == (3, 3)


# ---- budget: affinity mask ------------------------------------------------------------------

_ONE_CPU_ENGINE = """
import json, os
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import torch
from engine import LLM, SamplingParams
from engine.runtime.cpu_threads import cpu_budget
budget = cpu_budget()
llm = LLM(max_num_seqs=2)
threads_built = torch.get_num_threads()
out = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]],
                   SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
print(json.dumps({"budget": budget.threads, "affinity": budget.affinity_cpus,
                  "threads_built": threads_built, "threads_after": torch.get_num_threads(),
                  "engine": llm.engine.threads.threads,
                  "max": llm.engine.threads.governor.max_threads,
                  "stats": llm.engine.stats().num_threads, "tokens": len(out.token_ids)}))
"""


def test_budget_and_engine_follow_a_one_cpu_affinity_mask():
    proc = subprocess.run([sys.executable, "-c", _ONE_CPU_ENGINE], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"budget": 1, "affinity": 1, "threads_built": 1, "threads_after": 1,
                   "engine": 1, "max": 1, "stats": 1, "tokens": 4}


# ---- token output does not depend on the thread count ---------------------------------------

_TEXTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type with an oil-based ink and a screw press adapted "
    "from the ones used to make wine. Within fifty years presses were running in more than "
    "two hundred cities.",
    "To bake a simple loaf of bread, mix flour, water, salt and yeast into a dough, knead it "
    "for about ten minutes until it is smooth, and let it rise in a warm place until doubled.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fibonacci(i) for i in range(10)])\n# The output of this program is",
)
PROMPT_TOKENS = 40


def _tokens(outs) -> list[list[int]]:
    return [list(o.token_ids) for o in outs]


def _differences(runs: dict[str, list]) -> str:
    """Where the runs' tokens part, with each run's top-2 logprob gap there."""
    lines = []
    names = list(runs)
    ref = runs[names[0]]
    for name in names[1:]:
        for p, (a, b) in enumerate(zip(ref, runs[name], strict=True)):
            ta, tb = list(a.token_ids), list(b.token_ids)
            if ta == tb:
                continue
            i = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)

            def gap(o, i=i):
                lp = o.logprobs[i]
                return f"{lp.token_id} ({lp.top[0][1] - lp.top[1][1]:.4f} over the 2nd)"

            lines.append(f"prompt {p} position {i}: {names[0]} {gap(a)} vs {name} {gap(b)}")
    return "; ".join(lines)


def test_greedy_tokens_do_not_depend_on_the_thread_count(torch_threads):
    from engine import LLM, SamplingParams

    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24, logprobs=2)
    runs = {}
    # fp32 weights: the claim is the float kernels'; a quantized model's plan at each thread
    # count may take the integer products or not, which round differently (docs/models.md)
    fp = dict(quantization="none")

    llm = LLM(max_num_seqs=4, num_threads=2, adaptive_threads=False, **fp)
    prompts = [llm.tokenizer.encode(t)[:PROMPT_TOKENS] for t in _TEXTS]
    assert all(len(p) == PROMPT_TOKENS for p in prompts)
    assert llm.engine.threads.threads == 2
    runs["2 threads"] = llm.generate(prompts, sp)
    assert torch.get_num_threads() == 2 and llm.engine.stats().num_threads == 2
    del llm
    gc.collect()

    llm = LLM(max_num_seqs=4, num_threads=1, adaptive_threads=False, **fp)
    runs["1 thread"] = llm.generate(prompts, sp)
    assert torch.get_num_threads() == 1 and llm.engine.stats().num_threads == 1
    del llm
    gc.collect()

    # A 2-thread engine that its governor drops to 1 thread in the middle of the requests.
    llm = LLM(max_num_seqs=4, num_threads=2, adaptive_threads=True, **fp)
    threads = llm.engine.threads
    assert threads.adaptive and threads.on_change is not None and threads.threads == 2
    # The fake clock goes on from the real one the governor was built on (its back-offs).
    clock, stolen = FakeClock(time.monotonic() + 1.0), FakeStolen()
    threads._clock, threads._stolen = clock, stolen  # no window ends until the test says so
    threads.idle()
    final, switched_at = {}, None
    for out in llm.stream(prompts, sp):
        if out.finished:
            final[out.request_id] = out
        if switched_at is None and len(out.token_ids) >= 8:
            assert torch.get_num_threads() == 2
            clock.t += 1.0
            stolen.script.append((1.0, 1.0, 0.0))  # each of 2 threads lost half the window
            threads.after_step(1.0)
            assert threads.threads == 1 and torch.get_num_threads() == 1
            assert llm.engine.stats().num_threads == 1
            assert llm.engine.stats().cpu_stolen == pytest.approx(0.5)
            switched_at = len(out.token_ids)
    assert switched_at is not None and switched_at < sp.max_tokens
    assert torch.get_num_threads() == 1 and threads.governor.num_changes == 1
    runs["2 -> 1 threads mid-run"] = sorted(final.values(),
                                            key=lambda o: prompts.index(o.prompt_token_ids))
    del llm, threads
    gc.collect()

    tokens = {name: _tokens(outs) for name, outs in runs.items()}
    assert all(len(t) == sp.max_tokens for ts in tokens.values() for t in ts)
    assert len({json.dumps(t) for t in tokens.values()}) == 1, _differences(runs)
