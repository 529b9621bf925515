"""The default model (SmolLM2-135M-Instruct from its GGUF) answers a simple question."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine import LLM, SamplingParams

QUESTION = "What is the capital of France?"


@pytest.mark.slow
def test_default_model_knows_paris():
    llm = LLM()
    out = llm.chat([[{"role": "user", "content": QUESTION}]],
                   SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.slow
def test_cli_generate_local_prints_answer():
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "generate", "--local", QUESTION, "--max-tokens", "24"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_cli_rejects_bad_sampling_with_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "generate", "--local", QUESTION, "--top-p", "2"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "top_p" in proc.stderr
