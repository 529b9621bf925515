"""bench/studies/dtype_steps.py end to end on the tiny model: every (dtype, batch) runs in its own
process in each round, the order alternates, and the ratios are the medians' ratios."""

from __future__ import annotations

import json

import pytest

from bench.studies import dtype_steps


def test_dtype_steps_times_both_dtypes_in_fresh_processes(tiny_llama_dir, tmp_path):
    assert dtype_steps.main(["--model", str(tiny_llama_dir), "--batches", "2", "--rounds",
                             "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "dtype_steps.json").read_text())
    runs = data["runs"]
    assert [(r["round"], r["dtype"], r["batch"]) for r in runs] == [
        (1, "float32", 2), (1, "bfloat16", 2), (2, "bfloat16", 2), (2, "float32", 2)]
    assert all(r["prefill_step_s"] > 0 and r["decode_step_s"] > 0 for r in runs)
    for b in (2,):
        m = data["median"]
        r = data["bf16_over_fp32"][f"batch {b}"]["decode_step_s"]
        assert r == pytest.approx(m[f"bfloat16/{b}"]["decode_step_s"]
                                  / m[f"float32/{b}"]["decode_step_s"])
