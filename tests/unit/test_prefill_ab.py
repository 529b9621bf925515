"""bench/prefill_ab.py: both prefill attention paths timed on whole prefills, same engine."""

from __future__ import annotations

import re

from bench import prefill_ab


def test_prefill_ab_times_both_paths_per_length(tiny_llama_dir, capsys):
    rows = prefill_ab.measure(str(tiny_llama_dir), [5, 40], rounds=2)
    assert [r.length for r in rows] == [5, 40]
    assert all(r.sdpa_ms > 0 and r.fused_ms > 0 and r.speedup == r.sdpa_ms / r.fused_ms
               for r in rows)
    assert prefill_ab.main(["--model", str(tiny_llama_dir), "--lengths", "7", "--rounds", "1"]) == 0
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(r"prompt 7: sdpa [\d.]+ ms, fused [\d.]+ ms, sdpa / fused [\d.]+x", line), line
