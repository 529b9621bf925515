"""GPU-test fixtures: a tiny model FlashInfer can run (head_dim 64); each failure's report is
printed the moment the test fails."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.tiny_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_hd64_dir(tmp_path_factory):
    """The tiny Llama with head_dim 64 (4 query heads over 2 KV heads): the shared tiny model
    has head_dim 16, which FlashInfer has no kernels for."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-hd64"), hidden_size=256,
                           intermediate_size=512)


def pytest_runtest_logreport(report):
    """Print a failed test's traceback and captured output now, not in the end-of-run summary.

    GPU runs are cut short by a wall-clock limit (``bench/gpu_check.sh``; a lent machine's
    budget): on 2026-12-04 one was killed before its summary and left two failures with no
    traceback. Printed here, the log holds them however the run ends."""
    if not report.failed:
        return
    out = [f"\n=== FAILED {report.nodeid} ({report.when})", report.longreprtext]
    out += [f"--- {name}\n{text}" for name, text in report.sections if text.strip()]
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.flush()
