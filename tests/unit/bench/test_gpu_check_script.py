"""``bench/gpu_check.sh`` on a machine without CUDA (every CI machine): it runs end to end with
the interpreter ``PDCLUSTER_PY`` names, keeps the pytest log beside its JSON, records per check
that CUDA is missing, and exits non-zero (nothing was checked). The GPU side itself runs only
on a GPU machine (docs/history/2026-12-03-wave-3-engine.md, "GPU path")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


def _run(tmp_path: Path, py: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "gc.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PDCLUSTER_PY"] = py
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    return proc, out


def test_without_cuda_every_check_says_so_and_the_script_fails(tmp_path):
    proc, out = _run(tmp_path, sys.executable)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["environment"]["cuda_available"] is False
    checks = report["checks"]
    assert {"flashinfer_vs_torch", "tokens_vs_cpu", "decode_vs_hbm_floor"} <= set(checks)
    assert all(c["error"] == "CUDA is not available" and not c["ok"] for c in checks.values())
    # pytest tests/gpu ran (every test skipped without CUDA) and its whole log is kept
    assert report["pytest_gpu"]["returncode"] == 0
    assert report["pytest_gpu"]["tests"] == report["pytest_gpu"]["skipped"] > 0
    assert "skipped" in (tmp_path / "gc_pytest.log").read_text()


def test_a_missing_interpreter_is_named(tmp_path):
    proc, out = _run(tmp_path, str(tmp_path / "no-such-python"))
    assert proc.returncode == 2
    assert "no-such-python not found" in proc.stderr
    assert not out.exists()
