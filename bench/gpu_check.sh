#!/usr/bin/env bash
# The GPU path, checked on one machine: `bash bench/gpu_check.sh [JSON_PATH]` from the repo root
# of a checkout that has run `make setup`. Under 10 minutes on one H200 (pip 90 s, pytest
# 240 s, the checks 250 s, each at its limit).
#
# 1. flashinfer: installed if missing (`pip install 'flashinfer-python>=0.6.6,<0.7'`, the
#    version range seen working on an H200; the only install this
#    script makes); a failed install is reported and the checks that need it fail alone.
# 2. pytest tests/gpu (its pass/fail counts go into the JSON, its log beside it).
# 3. python -m bench.gpu_check: each check in its own process under its own time limit;
#    JSON to JSON_PATH (default $OUT/gpu_check.json when $OUT is set, else ./gpu_check.json).
# Exits non-zero when any check or test failed; every check runs regardless.
#
# Environment: PDCLUSTER_PY, the interpreter (default .venv/bin/python; on a machine whose
# image already holds a CUDA torch, that image's python3 with the project on PYTHONPATH);
# GPU_CHECK_PYTEST_S, the limit on pytest tests/gpu (default 240 s: raise it on a machine
# whose FlashInfer JIT cache is cold, where the first run compiles every kernel it uses);
# GPU_CHECK_TEST_S, one test's limit (default 120 s, with pytest-timeout): a test that hangs
# fails alone and the rest still run and report.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PDCLUSTER_PY:-.venv/bin/python}
if ! command -v "$PY" >/dev/null; then
    echo "gpu_check: $PY not found: run 'make setup' first (or set PDCLUSTER_PY)" >&2
    exit 2
fi
PYTEST_S=${GPU_CHECK_PYTEST_S:-240}
TEST_S=${GPU_CHECK_TEST_S:-120}
if [[ $# -ge 1 ]]; then
    JSON=$1
elif [[ -n ${OUT:-} ]]; then
    JSON=$OUT/gpu_check.json
else
    JSON=./gpu_check.json
fi
mkdir -p "$(dirname "$JSON")"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

echo "=== torch and CUDA"
CUDA_OK=1
if ! $PY -c 'import torch, sys; print(torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(), "gpus", torch.cuda.device_count())
sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch sees no CUDA device (a CPU-only torch build, or no driver);" \
         "every check will record that" >&2
    CUDA_OK=0
fi

echo "=== flashinfer"
if [[ $CUDA_OK -eq 0 ]]; then
    echo "no CUDA: not installing flashinfer (it only runs on CUDA)"
elif ! $PY -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("flashinfer") is None)'; then
    echo "flashinfer is not installed: pip install 'flashinfer-python>=0.6.6,<0.7'"
    if ! timeout 90 $PY -m pip install -q 'flashinfer-python>=0.6.6,<0.7'; then
        echo "gpu_check: 'pip install flashinfer-python' failed; the FlashInfer checks will" \
             "fail and 'auto' will use the torch backend" >&2
    fi
fi

echo "=== pytest tests/gpu (limit $PYTEST_S s)"
# The whole log beside the JSON (a failure's traceback), its last lines here.
PYTEST_LOG=${JSON%.json}_pytest.log
PER_TEST=()
if $PY -c 'import pytest_timeout' 2>/dev/null; then
    PER_TEST=(--timeout "$TEST_S")
fi
timeout "$PYTEST_S" $PY -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rfE "${PER_TEST[@]}" \
    --junitxml="$WORK/gpu.xml" 2>&1 | tee "$PYTEST_LOG" | tail -n 40
PYTEST_RC=${PIPESTATUS[0]}
$PY - "$WORK/gpu.xml" "$PYTEST_RC" > "$WORK/pytest.json" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
path, rc = sys.argv[1], int(sys.argv[2])
res = {"returncode": rc}
try:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    for key in ("tests", "failures", "errors", "skipped"):
        res[key] = int(suite.get(key, 0))
    res["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                     if c.find("failure") is not None or c.find("error") is not None]
except Exception as e:  # a timeout leaves no report
    res["error"] = f"no junit report ({type(e).__name__}: {e}); rc={rc} (124: timed out)"
print(json.dumps(res))
EOF

echo "=== checks"
$PY -m bench.gpu_check --out "$JSON" --pytest-json "$WORK/pytest.json"
CHECK_RC=$?
if [[ $PYTEST_RC -ne 0 || $CHECK_RC -ne 0 ]]; then
    echo "gpu_check: FAILED (pytest rc=$PYTEST_RC, checks rc=$CHECK_RC); details in $JSON"
    exit 1
fi
echo "gpu_check: all passed; details in $JSON"
