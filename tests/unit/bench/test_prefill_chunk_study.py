"""bench/studies/prefill_chunk.py end to end on the tiny model: with a chunk cap the short
prompts behind a long one get their first tokens sooner, in more steps."""

from __future__ import annotations

import json

from bench.studies import prefill_chunk


def test_the_cap_takes_more_steps_and_the_short_prompts_wait_less(tiny_llama_dir, tmp_path):
    out = tmp_path / "pc.json"
    assert prefill_chunk.main(["--model", str(tiny_llama_dir), "--caps", "none,8",
                               "--long-len", "200", "--short-len", "4", "--shorts", "2",
                               "--gap-ms", "0", "--repeats", "1", "--out", str(out)]) == 0
    rows = {r["cap"]: r for r in json.loads(out.read_text())["rows"]}
    # none: the long prompt in one step, both short ones in the next
    assert rows[None]["steps"] == 2
    # 8: the long prompt's 200 tokens in 25 steps; the short ones ride along from the first
    assert rows[8]["steps"] == 25
    assert rows[8]["short_ttft_max_ms"] < rows[8]["long_ttft_ms"]
