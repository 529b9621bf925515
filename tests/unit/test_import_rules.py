"""The dependency rules of DESIGN §1, checked on the source: who may import (and reach into) whom.

``router -> {prefill_workers, decode_workers} -> {worker_protocol, kv_transfer} -> engine``;
the engine imports neither Ray nor gRPC; workers use the engine's seams (``kv_connector``, the
engine's public methods), never its scheduler, block manager or model runner; neither worker
kind imports the other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER_PACKAGES = ("prefill_workers", "decode_workers")
ENGINE_INSIDES = ("engine.scheduler", "engine.block_manager", "engine.model_runner")


def _modules(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules found under {package}/"
    return files


def _imports(path: Path) -> set[str]:
    """Every module name ``path`` imports, at top level or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in _modules(package):
        for name in sorted(_imports(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("package,forbidden", [
    ("engine", ("ray", "grpc", "router", "kv_transfer", "worker_protocol", *WORKER_PACKAGES)),
    ("kv_transfer", ("ray", "router", "worker_protocol", *WORKER_PACKAGES)),
    ("worker_protocol", ("router", *WORKER_PACKAGES)),
    ("prefill_workers", ("router", "decode_workers", *ENGINE_INSIDES)),
    ("decode_workers", ("router", "prefill_workers", *ENGINE_INSIDES)),
    ("client", ("ray", "engine", "router", "kv_transfer", *WORKER_PACKAGES)),
])
def test_import_direction(package, forbidden):
    assert _violations(package, forbidden) == []


@pytest.mark.parametrize("package", WORKER_PACKAGES)
def test_workers_do_not_reach_into_the_engine(package):
    """``self.engine.scheduler.x`` needs no import, so the rule is checked on attributes too."""
    found = []
    for path in _modules(package):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("scheduler", "block_manager",
                                                                 "runner"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses .{node.attr}")
    assert found == []


def test_the_checker_sees_a_violation(tmp_path):
    """The rule checks above would pass vacuously if the scan found nothing."""
    mod = tmp_path / "bad.py"
    mod.write_text("def f():\n    from engine.scheduler import Scheduler\n    import ray.util\n")
    assert {"engine.scheduler", "engine.scheduler.Scheduler", "ray.util"} <= _imports(mod)


def test_pure_core_loads_without_torch():
    """The scheduler and block manager are plain Python (DESIGN §8): importing them, and the
    config they share, must not pull torch in."""
    code = ("import sys, engine.scheduler, engine.block_manager, engine.config; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
