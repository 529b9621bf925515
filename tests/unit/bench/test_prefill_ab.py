"""bench/studies/prefill_ab.py: both prefill attention paths timed on whole prefills, same engine."""

from __future__ import annotations

import re

from bench.studies import prefill_ab
from engine.ops import cpu_ops


def test_prefill_ab_times_both_paths_per_length(tiny_llama_dir, capsys, monkeypatch):
    """Each length is timed on both paths, and the fused side really runs the kernel (the
    sdpa side never does): a kernel that declined would make the A/B compare SDPA with SDPA."""
    ran = []
    real = cpu_ops.prefill_attention

    def spy(q, *args):
        ok = real(q, *args)
        ran.append((q.shape[0], ok))
        return ok

    monkeypatch.setattr(cpu_ops, "prefill_attention", spy)
    rows = prefill_ab.measure(str(tiny_llama_dir), [5, 40], rounds=2)
    assert [r.length for r in rows] == [5, 40]
    assert all(r.sdpa_ms > 0 and r.fused_ms > 0 and r.speedup == r.sdpa_ms / r.fused_ms
               for r in rows)
    # the engine's start probes the kernel with one row; then per length 3 prefills (a warm-up
    # round, 2 timed) x the tiny model's 2 layers, every one taken by the kernel
    assert [r for r in ran if r[0] > 1] == [(5, True)] * 6 + [(40, True)] * 6
    assert prefill_ab.main(["--model", str(tiny_llama_dir), "--lengths", "7", "--rounds", "1"]) == 0
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(r"prompt 7: sdpa [\d.]+ ms, fused [\d.]+ ms, sdpa / fused [\d.]+x", line), line
