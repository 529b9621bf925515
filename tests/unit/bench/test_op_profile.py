"""bench/studies/op_profile.py on the tiny model: the op table, the matmul share with its bandwidth,
and both one-row passes are printed."""

from __future__ import annotations

import re

from bench.studies import op_profile


def test_op_profile_splits_the_step_and_times_both_passes(tiny_llama_dir, capsys):
    assert op_profile.main(["--model", str(tiny_llama_dir), "--batch", "2", "--steps", "2",
                            "--layer-by-layer"]) == 0
    out = capsys.readouterr().out
    assert "decode step: layer by layer" in out
    assert "aten::mm" in out
    step = re.search(r"batch 2: step ([\d.]+) ms .* torch ops ([\d.]+) ms, of which aten::mm "
                     r"([\d.]+) ms \(([\d.]+) GB/s", out)
    assert step, out
    wall, torch_ms, mm_ms, gb_s = map(float, step.groups())
    assert 0 < mm_ms <= torch_ms and wall > 0 and gb_s > 0
    assert len(re.findall(r"one-row pass .* layers only .* with the LM head", out)) == 2
