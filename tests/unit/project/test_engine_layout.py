"""engine/'s map (docs/architecture.md, "engine/ by concern"), checked on the source: what each
subpackage may import, what loads without torch, and the size limits that keep it a map.

- The contract and the configuration (``engine.args``, ``engine.config``, ``engine.contract``,
  ``engine.models.config``) and the pure core (``engine.core``) load without torch.
- ``engine.executor`` reaches attention only through its protocol (``engine.attention.backend``)
  and factory, never a backend's module.
- ``engine.parallel`` (sharding and the ranks' transport) imports nothing above it: only
  itself and the plain configuration.
- The router imports the engine's public surface only (``ROUTER_MAY_IMPORT``), never its
  scheduler, model runner, kernels or models.
- engine/'s top level holds at most six modules; no project module is over 500 lines.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.unit.project.test_import_rules import (
    ROOT,
    _imports,
    _modules,
    _project_modules,
    _resolve,
)

TORCH_FREE = ("engine", "engine.args", "engine.config", "engine.contract",
              "engine.models.config", "engine.core", "engine.weights.resolve",
              "engine.weights.converted")

# What router/ may import from engine/, each with the reason the router needs it.
ROUTER_MAY_IMPORT = (
    "engine",  # the lazy package: EngineArgs, SamplingParams, LLM (`pdcluster generate`)
    "engine.args", "engine.config", "engine.contract",  # what a request and an engine are
    "engine.spec.config",  # --speculative-config is checked before any worker starts
    "engine.core.grammar",  # structured outputs: the door checks a grammar before queueing
    "engine.core.step_times",  # the step-time histogram the door exports
    "engine.core.kv_events",  # KV-aware routing indexes the workers' events
    "engine.core.block_manager",  # ... with the block hashes the workers use (hash_block)
    "engine.text.tokenizer", "engine.text.input_processor",  # prompts checked at the router
    "engine.weights.resolve",  # the cluster side finds the model and reads its config
    "engine.tuning.profile",  # the planner reads (and `pdcluster profile` takes) a profile
    "engine.runtime.async_engine",  # the embedded backend runs one engine in-process
    "engine.runtime.cpu_threads",  # the CPU budget `pdcluster serve` splits among workers
    "engine.parallel.sharding",  # a worker's tensor-parallel shape
    "engine.lora.request",  # LoRARequest: which adapter a request runs under (plain data)
)


def _engine_modules() -> dict[str, object]:
    return {m: p for m, p in _project_modules().items() if m == "engine"
            or m.startswith("engine.")}


def _engine_imports(package: str) -> list[tuple[str, str]]:
    """(importing module, imported engine module) for every module under ``package``."""
    modules = _project_modules()
    pairs = []
    for name, path in modules.items():
        if name != package and not name.startswith(package + "."):
            continue
        for imported in _imports(path):
            target = _resolve(imported, modules)
            if target and (target == "engine" or target.startswith("engine.")):
                pairs.append((name, target))
    return sorted(set(pairs))


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_contract_config_and_core_load_without_torch():
    core = sorted(m for m in _engine_modules() if _within(m, ("engine.core",)))
    assert "engine.core.scheduler" in core and "engine.core.block_manager" in core
    names = [m for m in TORCH_FREE if m != "engine.core"] + core
    code = f"import sys\nfor m in {names!r}: __import__(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_the_router_loads_without_torch_until_it_builds_workers():
    """`pdcluster serve` parses and checks its flags, resolves the model and reads its config
    with no torch: torch comes with the worker classes Ray is handed (or an in-process engine)."""
    names = ["router.cli.main", "router.cli.serve", "router.cli.serve_config",
             "router.cluster.ray_cluster", "router.frontdoor.lifecycle", "router.embedded"]
    code = f"import sys\nfor m in {names!r}: __import__(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_executor_reaches_attention_only_through_its_protocol():
    found = [f"{a} imports {b}" for a, b in _engine_imports("engine.executor")
             if _within(b, ("engine.attention",))
             and b not in ("engine.attention.backend", "engine.attention.factory")]
    assert found == []


def test_parallel_imports_nothing_above_it():
    allowed = ("engine.parallel", "engine.config", "engine.models.config")
    found = [f"{a} imports {b}" for a, b in _engine_imports("engine.parallel")
             if not _within(b, allowed)]
    assert found == []


def test_router_imports_only_the_engines_public_surface():
    found = [f"{a} imports {b}" for a, b in _engine_imports("router")
             if b not in ROUTER_MAY_IMPORT]
    assert found == []


def test_the_rules_see_a_violation(tmp_path):
    """The checks above would pass vacuously if the scan found no engine import."""
    assert ("router.embedded", "engine.runtime.async_engine") in _engine_imports("router")
    assert any(b == "engine.attention.backend" for _, b in _engine_imports("engine.executor"))
    mod = tmp_path / "bad.py"
    mod.write_text("from engine.attention.torch_paged import TorchPagedBackend\n")
    assert "engine.attention.torch_paged" in _imports(mod)


def test_engine_top_level_is_a_map():
    top = sorted(p.name for p in (ROOT / "engine").glob("*.py"))
    assert len(top) <= 6, top


@pytest.mark.parametrize("package", ["engine", "router", "kv_transfer", "worker_protocol",
                                     "prefill_workers", "decode_workers", "client", "bench"])
def test_no_module_over_500_lines(package):
    long = [f"{p.relative_to(ROOT)}: {n}" for p in _modules(package)
            if (n := len(p.read_text().splitlines())) > 500]
    assert long == []
