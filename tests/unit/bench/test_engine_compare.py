"""bench.engine.engine_compare end to end on the tiny model: each system in its own process, the
issue's workload (3 requests in turn at batch 1, 32 at once), results written."""

import json
import subprocess
import sys


def test_engine_compare_runs_ours_and_transformers_alternating(tiny_llama_dir, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "bench.engine.engine_compare", "--model", str(tiny_llama_dir),
         "--transformers", "--rounds", "1", "--threads", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "engine_compare.json").read_text())
    assert set(data["runs"]) == {"ours", "transformers"}
    for system in ("ours", "transformers"):
        for batch in ("1", "32"):
            [tok_s] = data["runs"][system][batch]
            assert tok_s > 0
    assert "ours / transformers: batch 1" in out.stdout
